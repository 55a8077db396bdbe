"""The torch.compile flags of pretrain_gpt.py and the combinations they refuse.

    --torch-compile                     compile each transformer layer and the output head (GPTModel.compile_layers)
    --torch-compile-scope layers|model  per layer, or the whole forward as one graph (GPTModel.compile_forward)
    --torch-compile-mode MODE           torch.compile's mode; two of them capture CUDA graphs

They refine the model, so `add_compile_arguments` adds them to the model's argument group; pretrain_gpt.py's
model_provider applies them. `check_compile_args` refuses what cannot run under ZeRO-3.
"""

import argparse

COMPILE_SCOPES = ("layers", "model")  # GPTModel.compile_layers / compile_forward
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs


def add_compile_arguments(g: argparse._ArgumentGroup) -> None:
    """Adds the flags to `g`, the model's argument group (where --help lists them)."""
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each transformer layer and the output head separately (GPTModel."
                        "compile_layers; --torch-compile-scope model: the whole forward): faster on GPUs, the "
                        "first iterations slower while it compiles; numerics close to eager, not bitwise "
                        "(docs/performance.md)")
    g.add_argument("--torch-compile-scope", choices=COMPILE_SCOPES,
                   help="with --torch-compile: 'layers' (the default) compiles each layer and the output head on "
                        "its own, so gradient buckets still reduce during backward; 'model' compiles the whole "
                        "forward as one graph (GPTModel.compile_forward): more fusion, but every gradient arrives "
                        "at the end of backward, so all buckets reduce then, with no overlap. Not with "
                        "--data-parallel-sharding-strategy optim_grads_params (ZeRO-3)")
    g.add_argument("--torch-compile-mode", choices=COMPILE_MODES,
                   help="with --torch-compile: torch.compile's mode (default: torch's 'default'); "
                        "'max-autotune-no-cudagraphs' tries several matmul kernels per shape (compiles for "
                        "minutes), 'reduce-overhead' and 'max-autotune' also capture CUDA graphs (not with "
                        "--data-parallel-sharding-strategy optim_grads_params: ZeRO-3 moves parameter storage)")


def check_compile_args(args, ddp_config):
    """--torch-compile-scope and --torch-compile-mode refine --torch-compile (`ddp_config`: the one check_configs
    built from `args`). A whole-forward graph cannot run under ZeRO-3: it keeps the storage of parameters that
    the wrapper releases between layers (the wrapper refuses it too; here the message names the flags). Nor can
    CUDA graphs: they replay captured addresses, and ZeRO-3 frees and regrows the parameters' storage."""
    for name in ("torch_compile_scope", "torch_compile_mode"):
        if getattr(args, name, None) is not None and not args.torch_compile:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} needs --torch-compile: add --torch-compile, or drop {flag}")
    zero3 = ddp_config.sharding.parameters
    if getattr(args, "torch_compile_scope", None) == "model" and zero3:
        raise ValueError("--torch-compile-scope model cannot run with --data-parallel-sharding-strategy "
                         "optim_grads_params (ZeRO-3 releases parameters that the whole-forward graph keeps): "
                         "use --torch-compile-scope layers")
    if getattr(args, "torch_compile_mode", None) in CUDA_GRAPH_MODES and zero3:
        raise ValueError(f"--torch-compile-mode {args.torch_compile_mode} (CUDA graphs) cannot run with "
                         "--data-parallel-sharding-strategy optim_grads_params: ZeRO-3 frees and regrows each "
                         "layer's parameter storage, so the addresses a graph captured change; use "
                         "--torch-compile-mode default or max-autotune-no-cudagraphs")
