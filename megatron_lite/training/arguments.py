"""The command line of pretrain_gpt.py, spelled like Megatron-LM's, and the one mapping onto the configs.

Flags that set a config field are generated from the config dataclass: the table below names Megatron's
flag for each field, the flag's help text is the field's docstring, and the rules live in the config's
`__post_init__`. `parse_args` builds every config once to validate it, and turns a config's `ValueError`
into argparse's flag error (exit code 2), with field names rewritten as flags. What is not a config field
(batch sizes, intervals, data paths) is checked in `validate_args`. The data, torch.compile and checkpoint
flags have modules of their own (data_arguments.py, compile_arguments.py, checkpoint_arguments.py: an add_*
function for the parser and a check_* function that validate_args or check_configs calls), as have
--optimizer-class / --optimizer-kwargs (optimizer_class_arguments.py: they map onto OptimizerConfig's fields).
"""

import argparse
import dataclasses
import math
import os
import shlex

import torch

from ..config_checks import Check, check_fields
from ..distributed import DistributedDataParallelConfig
from ..distributed.distributed_data_parallel_config import OPTIMIZER_SHARDING_STRATEGIES, SHARDING_STRATEGIES
from ..distributed.layout import DataParallelTopology
from ..models import GPTConfig
from ..optimizer import OptimizerConfig, check_optimizer_matches_ddp
from ..optimizer.muon import COEFFICIENT_SETS, SCALE_MODES
from .checkpoint_arguments import add_checkpoint_arguments, check_checkpoint_args
from .compile_arguments import add_compile_arguments, check_compile_args
from .config_flags import add_config_arguments, config_from_args, field_docs, rewrite_field_names
from .data_arguments import add_data_arguments, check_data_args
from .optimizer_class_arguments import FLAGS as OPTIMIZER_CLASS_FLAGS
from .optimizer_class_arguments import add_optimizer_class_arguments, optimizer_class_from_args
from .scheduler import check_schedule

# Megatron's flag for every config field a flag sets: the one mapping from the command line to the configs.
DDP_FLAGS = {
    "overlap_grad_reduce": "--overlap-grad-reduce",
    "overlap_param_gather": "--overlap-param-gather",
    "use_distributed_optimizer": "--use-distributed-optimizer",  # sets OptimizerConfig's field too
    "data_parallel_sharding_strategy": "--data-parallel-sharding-strategy",
    "bucket_size": "--ddp-bucket-size",
    "num_buckets": "--ddp-num-buckets",
    "average_in_collective": "--ddp-average-in-collective",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",  # or --bf16
    "check_for_nan_in_grad": "--check-for-nan-in-loss-and-grad",
    "calculate_per_token_loss": "--calculate-per-token-loss",
    "num_distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "reduce_scatter_with_fp32_accumulation": "--ddp-reduce-scatter-with-fp32-accumulation",
    "prefetch_bucket_size": "--ddp-prefetch-bucket-size",  # DeepSpeed's stage3_prefetch_bucket_size
    "max_reuse_distance": "--ddp-max-reuse-distance",  # DeepSpeed's stage3_max_reuse_distance
    "param_persistence_threshold": "--ddp-param-persistence-threshold",  # stage3_param_persistence_threshold
}
# Sequence-valued DDP fields: one flag taking several values (nargs='+'), added and mapped by hand.
DDP_LIST_FLAGS = {
    "param_name_patterns_for_fp32_local_accumulation": "--ddp-param-name-patterns-for-fp32-local-accumulation",
}
OPTIMIZER_FLAGS = {  # params_dtype follows from --fp16 / --bf16
    "optimizer": "--optimizer", "lr": "--lr", "min_lr": "--min-lr", "weight_decay": "--weight-decay",
    "clip_grad": "--clip-grad", "adam_beta1": "--adam-beta1", "adam_beta2": "--adam-beta2",
    "adam_eps": "--adam-eps", "sgd_momentum": "--sgd-momentum",
    "fp16": "--fp16", "bf16": "--bf16", "loss_scale": "--loss-scale", "initial_loss_scale": "--initial-loss-scale",
    "min_loss_scale": "--min-loss-scale", "loss_scale_window": "--loss-scale-window", "hysteresis": "--hysteresis",
    "optimizer_cpu_offload": "--optimizer-cpu-offload", "optimizer_offload_fraction": "--optimizer-offload-fraction",
}
GPT_FLAGS = {  # vocab_size comes from the tokenizer; position type, tying, biases, activation and dtype are
    # mapped by hand below (gpt_config_from_args)
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size", "max_position_embeddings": "--max-position-embeddings",
    "hidden_dropout": "--hidden-dropout", "attention_dropout": "--attention-dropout",
    "init_method_std": "--init-method-std", "normalization": "--normalization",
    "gated_linear_unit": "--swiglu",  # sets activation_func='silu' too
    "num_query_groups": "--num-query-groups",  # with --group-query-attention
    "layernorm_epsilon": "--norm-epsilon", "rotary_base": "--rotary-base",
}
SCHEDULE_FLAGS = {"lr_warmup_steps": "--lr-warmup-iters", "lr_decay_steps": "--lr-decay-iters",
                  "lr_decay_style": "--lr-decay-style"}

# ------------------------------------------------------------------------------------------ Muon's flags
# --optimizer muon: OptimizerConfig's muon_* fields (megatron-core's names) under Megatron-LM's flags, with
# Megatron-LM's CLI defaults. --muon-no-split-qkv (Megatron's negative switch, dest muon_split_qkv) is mapped
# by hand (optimizer_config_from_args).
MUON_FLAGS = {"muon_momentum": "--muon-momentum", "muon_nesterov": "--muon-nesterov",
              "muon_scale_mode": "--muon-scale-mode", "muon_coefficient_type": "--muon-coefficient-type",
              "muon_num_ns_steps": "--muon-num-ns-steps", "muon_extra_scale_factor": "--muon-extra-scale-factor",
              "muon_scalar_optimizer": "--muon-scalar-optimizer"}
MUON_CLI_DEFAULTS = dict(muon_momentum=0.9)  # Megatron-LM's --muon-momentum; megatron-core's config says 0.95
MUON_NOT_OFFERED = {  # Megatron-LM's Muon flags that mean nothing here: a flag error, never silently ignored
    "--muon-fp32-matmul-prec": "Newton-Schulz runs torch.optim.Muon's bf16 matmuls here: there is no fp32 matmul "
                               "precision to choose; drop the flag",
    "--muon-tp-mode": "megatron-lite has no tensor parallelism: every matrix is orthogonalized whole, on the rank "
                      "that owns it; drop the flag",
    "--muon-use-syrk": "there is no Triton SYRK kernel here (Newton-Schulz uses torch.matmul); drop the flag",
}
MUON_HELP = (
    "--optimizer muon: Newton-Schulz-orthogonalized momentum (Muon) for the 2-D weight matrices, learned position "
    "embeddings included (Megatron's rule); the word embeddings, the output layer, norms and biases go to AdamW "
    "(--adam-beta1/2, --adam-eps, --weight-decay). Weight decay is torch.optim.Muon's, p *= 1 - lr x wd "
    "(Megatron's p -= lr x wd x p: equal up to rounding). Megatron-LM turns --optimizer muon "
    "--use-distributed-optimizer into its layer-wise distributed optimizer; here --use-distributed-optimizer and "
    "--data-parallel-sharding-strategy keep the distributed optimizer of Adam (flat shards of the buffers, in both "
    "checkpoint formats), each matrix gathered whole to the one rank that owns it for Newton-Schulz and its update "
    "sent back. Megatron's --muon-fp32-matmul-prec, --muon-tp-mode and --muon-use-syrk are refused.")


class _NotOffered(argparse.Action):
    """A flag of Megatron-LM's that has no meaning here: giving it is a flag error saying why."""

    def __init__(self, option_strings, dest, why, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, metavar="VALUE",
                         help="Megatron-LM's flag, not offered: " + why, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not offered: {self.why}")


def add_muon_arguments(parser):
    """The --muon-* flags, in a group of their own (MUON_HELP is its description)."""
    g = parser.add_argument_group("Muon (OptimizerConfig muon_*)", MUON_HELP.replace("%", "%%"))
    docs = field_docs(OptimizerConfig)
    add_config_arguments(g, OptimizerConfig, MUON_FLAGS, defaults=MUON_CLI_DEFAULTS,
                         muon_momentum=dict(help=docs["muon_momentum"] + " (default: 0.9)"),
                         muon_scale_mode=dict(choices=list(SCALE_MODES)),
                         muon_coefficient_type=dict(choices=list(COEFFICIENT_SETS)),
                         muon_scalar_optimizer=dict(choices=["adam", "lion"]))  # Megatron's; 'lion': the config's error
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalize each layer's fused linear_qkv.weight as one matrix (OptimizerConfig."
                        "muon_split_qkv=False; default: its Q, K and V row blocks each on its own, Megatron's)")
    for flag, why in MUON_NOT_OFFERED.items():
        g.add_argument(flag, action=_NotOffered, why=why)


def muon_config_fields(args) -> dict:
    """OptimizerConfig's muon_* fields from the flags (empty for a parser without them)."""
    flags = {**MUON_FLAGS, "muon_split_qkv": "--muon-no-split-qkv"}
    return {field: getattr(args, field) for field in flags if hasattr(args, field)}


def check_muon_args(args):
    """A --muon-* flag changed from its default without --optimizer muon would be silently ignored: an error."""
    if args.optimizer == "muon":
        return
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig) if f.name.startswith("muon_")}
    flags = {**MUON_FLAGS, "muon_split_qkv": "--muon-no-split-qkv"}
    given = [flag for field, flag in flags.items()
             if getattr(args, field, None) != MUON_CLI_DEFAULTS.get(field, defaults[field])]
    if given and getattr(args, "optimizer_class", None):  # --optimizer muon beside it is refused too
        raise ValueError(f"{', '.join(given)} set Muon's hyperparameters, which --optimizer-class "
                         f"{args.optimizer_class} does not read: drop them (the class's own go in --optimizer-kwargs)")
    if given:
        raise ValueError(f"{', '.join(given)} set Muon's hyperparameters, which --optimizer {args.optimizer} "
                         f"does not read: add --optimizer muon, or drop them")

# Every flag has Megatron-LM's default. A model preset fills the flags you do not give with a recipe
# that trains the preset's model well (printed at start-up); `--model-preset none` keeps Megatron's.
RECIPE = dict(lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta2=0.95, lr_decay_style="cosine",
              lr_warmup_fraction=0.1, hidden_dropout=0.0, attention_dropout=0.0, micro_batch_size=4,
              global_batch_size=16, train_iters=200, log_interval=10, eval_interval=100, eval_iters=5)
MODEL_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, **RECIPE),
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, **RECIPE),
    "gpt2-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, **RECIPE),
    # Llama's architecture at tiny's size: RMSNorm, SwiGLU (ffn 320 by Megatron's rule), 2 key/value groups,
    # rotary positions, no linear biases, an output layer of its own.
    "llama-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, normalization="RMSNorm",
                       swiglu=True, group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
                       position_embedding_type="rope", untie_embeddings_and_output_weights=True, **RECIPE),
    "none": {},
}
# Megatron-LM's defaults of the flags a preset may set (None: required, or derived from other flags).
MEGATRON_DEFAULTS = dict(num_layers=None, hidden_size=None, num_attention_heads=None, seq_length=None, lr=None,
                         min_lr=0.0, weight_decay=0.01, adam_beta2=0.999, lr_decay_style="linear",
                         lr_warmup_fraction=None, hidden_dropout=0.1, attention_dropout=0.1, micro_batch_size=None,
                         global_batch_size=None, train_iters=None, log_interval=100, eval_interval=1000,
                         eval_iters=100, normalization="LayerNorm", swiglu=False, group_query_attention=False,
                         disable_bias_linear=False, position_embedding_type="learned_absolute",
                         untie_embeddings_and_output_weights=False)
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


# ------------------------------------------------------------------------------------------ configs from flags
def params_dtype_from_args(args) -> torch.dtype:
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    # --bf16 implies fp32 gradient accumulation and reduction, as in Megatron, unless --grad-reduce-in-bf16.
    bf16_reduce = getattr(args, "grad_reduce_in_bf16", False)
    if bf16_reduce and (not args.bf16 or args.accumulate_allreduce_grads_in_fp32):
        raise ValueError("--grad-reduce-in-bf16 needs --bf16, and contradicts --accumulate-allreduce-grads-in-fp32")
    patterns = tuple(getattr(args, "ddp_param_name_patterns_for_fp32_local_accumulation", None) or ())
    fp32_reduce_scatter = getattr(args, "ddp_reduce_scatter_with_fp32_accumulation", False)
    if args.bf16 and not bf16_reduce and (patterns or fp32_reduce_scatter):
        raise ValueError("--bf16 accumulates and reduces gradients in fp32 (Megatron's rule): add "
                         "--grad-reduce-in-bf16 to reduce them in bfloat16 with --ddp-reduce-scatter-with-fp32-"
                         "accumulation or --ddp-param-name-patterns-for-fp32-local-accumulation")
    fp32 = args.accumulate_allreduce_grads_in_fp32 or (args.bf16 and not bf16_reduce)
    return config_from_args(DistributedDataParallelConfig, DDP_FLAGS, args, grad_reduce_in_fp32=fp32,
                            param_name_patterns_for_fp32_local_accumulation=patterns,
                            use_distributed_optimizer=use_distributed_optimizer_from_args(args))


def optimizer_config_from_args(args) -> OptimizerConfig:
    return config_from_args(OptimizerConfig, OPTIMIZER_FLAGS, args, params_dtype=params_dtype_from_args(args),
                            use_distributed_optimizer=use_distributed_optimizer_from_args(args),
                            **optimizer_class_from_args(args),  # optimizer_class_arguments.py
                            **muon_config_fields(args))


def use_distributed_optimizer_from_args(args) -> bool:
    """--use-distributed-optimizer, or a --data-parallel-sharding-strategy that shards the optimizer state:
    the same answer in both configs (DistributedDataParallelConfig refuses 'no_shard' with the flag)."""
    return args.use_distributed_optimizer or args.data_parallel_sharding_strategy in OPTIMIZER_SHARDING_STRATEGIES


def gpt_config_from_args(args, vocab_size: int) -> GPTConfig:
    groups = args.num_query_groups
    if groups is not None and not args.group_query_attention:  # Megatron would silently ignore it
        raise ValueError("--num-query-groups needs --group-query-attention")
    if args.group_query_attention and groups is None:
        groups = 1  # Megatron's default for --num-query-groups: one key/value head (multi-query attention)
    openai_gelu = getattr(args, "openai_gelu", False)  # absent from namespaces built before the flag
    if openai_gelu and args.swiglu:  # Megatron-LM's core models would silently take SiLU
        raise ValueError("--openai-gelu and --swiglu both choose the MLP's activation (--swiglu: gated SiLU): "
                         "give one")
    return config_from_args(
        GPTConfig, GPT_FLAGS, args, vocab_size=vocab_size, params_dtype=params_dtype_from_args(args),
        position_embedding_type="rope" if args.position_embedding_type == "rope" else "learned",
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        num_query_groups=groups,
        activation_func="silu" if args.swiglu else "openai_gelu" if openai_gelu else "gelu",
        add_bias_linear=not args.disable_bias_linear)


def flag_error_message(error: ValueError) -> str:
    """A config's message with its field names replaced by the flags that set them ('overlap_param_gather
    =True requires use_distributed_optimizer=True' -> '--overlap-param-gather requires ...')."""
    table = {**GPT_FLAGS, **OPTIMIZER_FLAGS, **OPTIMIZER_CLASS_FLAGS, **SCHEDULE_FLAGS, **DDP_FLAGS, **DDP_LIST_FLAGS,
             **MUON_FLAGS}
    table.pop("optimizer")  # also an English word in messages; argparse's choices guard its values
    # muon_split_qkv's flag is its negative: only the value that flag sets can be spelled as it
    return rewrite_field_names(str(error).replace("muon_split_qkv=False", "--muon-no-split-qkv"), table)


def check_configs(args):
    """Build every config from `args` (raises the configs' ValueError); the vocabulary is not known before
    the tokenizer is built, so the model config is checked with a placeholder vocabulary."""
    ddp_config = ddp_config_from_args(args)
    check_optimizer_matches_ddp(optimizer_config_from_args(args), ddp_config)
    check_compile_args(args, ddp_config)
    gpt_config_from_args(args, vocab_size=1)
    check_schedule(args.lr_warmup_iters, args.lr_decay_iters, args.lr_decay_style)


# ------------------------------------------------------------------------------------------ the parser
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def as_flags(values: dict) -> str:
    """{dest: value} as the flags that parse back to the same values, to paste into a command: a switch set
    (True) bare, one not set (False) left out, every other value quoted for the shell where it needs it."""
    return " ".join(f"--{key.replace('_', '-')}" + ("" if value is True else f" {shlex.quote(str(value))}")
                    for key, value in values.items() if value is not False)


def _preset_architecture(preset: dict) -> str:
    """The flags a preset sets beyond its size and the recipe, spelled as flags (' (--swiglu ...)')."""
    flags = as_flags({k: v for k, v in preset.items() if k not in RECIPE and k not in ARCHITECTURE_KEYS})
    return f" ({flags})" if flags else ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Megatron-style GPT pre-training with megatron_lite (launch with torchrun).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model (GPTConfig)")
    g.add_argument("--model-preset", choices=list(MODEL_PRESETS), default="tiny",
                   help="fills the flags you do not give (printed at start-up): " + "; ".join(
                       f"{k}: {v['num_layers']} layers, hidden {v['hidden_size']}, {v['num_attention_heads']} "
                       f"heads, seq {v['seq_length']}" + _preset_architecture(v)
                       for k, v in MODEL_PRESETS.items() if v)
                   + "; all with the recipe " + as_flags(RECIPE)
                   + ". none: Megatron's defaults, the architecture flags required")
    docs = field_docs(GPTConfig)
    add_config_arguments(g, GPTConfig, GPT_FLAGS, max_position_embeddings=dict(
        help=docs["max_position_embeddings"] + " (default: --seq-length)"),
        normalization=dict(choices=["LayerNorm", "RMSNorm"]),
        num_query_groups=dict(help=docs["num_query_groups"] + " Needs --group-query-attention (default with it: 1, "
                                   "Megatron's)"))
    g.add_argument("--seq-length", type=int, help="tokens per sample")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                   help="learned absolute position embeddings added to the input, or rotary embeddings in attention")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of reusing the word-embedding matrix")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the attention and MLP linear layers (GPTConfig.add_bias_linear=False)")
    g.add_argument("--openai-gelu", action="store_true",
                   help="the MLP's GELU in its tanh approximation (GPTConfig.activation_func='openai_gelu'; GPT-2's "
                        "original, transformers' 'gelu_new') instead of the exact erf form; not with --swiglu")
    add_compile_arguments(g)  # compile_arguments.py: the --torch-compile flags refine the model

    g = p.add_argument_group("training and mixed precision (OptimizerConfig)")
    g.add_argument("--micro-batch-size", type=int, help="samples per rank per micro-batch")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per iteration; each rank accumulates global / (micro x data-parallel size) "
                        "micro-batches (Megatron's default: micro-batch size x data-parallel size)")
    g.add_argument("--train-iters", type=int, help="iterations to train for")
    g.add_argument("--seed", type=int, default=1234, help="seeds the model init (identical on every rank), "
                                                          "data shuffling and dropout")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible reruns on GPUs: deterministic kernels only (torch."
                        "use_deterministic_algorithms; an op without one is an error), NCCL_ALGO=Ring and "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8 unless already set to a reproducible value (Megatron's flag)")
    precision = ("fp16", "bf16", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                 "hysteresis")
    add_config_arguments(g, OptimizerConfig, {k: OPTIMIZER_FLAGS[k] for k in precision})
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: keep and reduce gradients in bf16 instead of fp32 (Megatron's flag; "
                        "docs/performance.md has the error it costs)")

    g = p.add_argument_group("optimizer (OptimizerConfig) and learning-rate schedule")
    add_config_arguments(g, OptimizerConfig, {k: v for k, v in OPTIMIZER_FLAGS.items() if k not in precision},
                         defaults=dict(min_lr=0.0), optimizer=dict(choices=["adam", "sgd", "muon"]))
    g.add_argument("--lr-warmup-iters", type=int, help="iterations of linear warmup from 0 to --lr (default: 0)")
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of --lr-decay-iters (instead of "
                                                            "--lr-warmup-iters)")
    g.add_argument("--lr-decay-iters", type=int, help="iteration at which the decay reaches --min-lr (default: "
                                                      "--train-iters)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], help="shape of the decay after warmup")
    add_optimizer_class_arguments(g)  # optimizer_class_arguments.py: any elementwise torch.optim class

    add_muon_arguments(p)

    g = p.add_argument_group("data parallelism (DistributedDataParallelConfig)")
    add_config_arguments(g, DistributedDataParallelConfig, DDP_FLAGS,
                         data_parallel_sharding_strategy=dict(choices=SHARDING_STRATEGIES),
                         check_for_nan_in_grad=dict(
        action=argparse.BooleanOptionalAction, default=None,
        help=field_docs(DistributedDataParallelConfig)["check_for_nan_in_grad"] + " The loss is checked too; all "
             "ranks stop together (default: on, except with --fp16 dynamic loss scaling, whose overflows produce "
             "Inf on purpose)"))
    add_config_arguments(g, DistributedDataParallelConfig, DDP_LIST_FLAGS,
                         param_name_patterns_for_fp32_local_accumulation=dict(nargs="+", metavar="PATTERN",
                                                                              default=None))
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device (no memory) and let DistributedDataParallel materialize "
                        "it a tensor at a time, keeping only what this rank holds (with --data-parallel-sharding-"
                        "strategy optim_grads_params: its shards), for models larger than one rank; bit-identical to "
                        "the normal build (megatron_lite.meta_device_init)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, else gloo")
    g.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that waits longer than this fails instead of hanging")

    add_data_arguments(p)  # data_arguments.py

    g = p.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, help="iterations between log lines")
    g.add_argument("--eval-interval", type=int, help="iterations between evaluations (and one at the end)")
    g.add_argument("--eval-iters", type=int, help="global batches of validation data per evaluation")
    g.add_argument("--tensorboard-dir", help="TensorBoard event files (when tensorboard is installed)")
    g.add_argument("--metrics-file", help="JSONL metrics (default: TENSORBOARD_DIR or SAVE /metrics.jsonl)")
    add_checkpoint_arguments(g)  # checkpoint_arguments.py: --save, --load and what they do on resume
    # Flags a preset may set: no argparse default (None = not given), Megatron's default in the help.
    for action in p._actions:
        if action.dest in MEGATRON_DEFAULTS:
            action.default = None
            megatron = MEGATRON_DEFAULTS[action.dest]
            action.help = (action.help or "") + (f" (default: {megatron}" if megatron is not None else
                                                 " (default: none") + ", unless --model-preset sets it)"
    return p


def parse_args(argv=None, world_size=None) -> argparse.Namespace:
    """Parse and validate; errors exit with argparse's usage message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        parser.error(flag_error_message(e))
    return args


def validate_args(args, world_size: int):
    """Fill the defaults that depend on other flags, check what is not a config field, then build the
    configs (their ValueError names the field). Raises ValueError."""
    _fill_from_preset(args)
    check_fields(args, _REQUIRED_RULES)
    _fill_derived_defaults(args, world_size)
    check_fields(args, _RUN_RULES)
    _check_data_parallel(args, world_size)
    check_fields(args, _EVAL_RULES)
    check_checkpoint_args(args)
    check_data_args(args)
    check_fields(args, _DEVICE_RULES)
    _fill_device_and_outputs(args)
    check_fields(args, _OUTPUT_RULES)
    check_muon_args(args)
    check_configs(args)
    return args


def _fill_from_preset(args):
    """The flags not given: the preset's value (recorded in args.preset_values, printed at start-up), else
    Megatron's default."""
    args.preset_values = {}
    for key, value in MODEL_PRESETS[args.model_preset].items():
        if getattr(args, key) is None and not (key == "lr_warmup_fraction" and args.lr_warmup_iters is not None):
            setattr(args, key, value)
            args.preset_values[key] = value
    for key, value in MEGATRON_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _fill_derived_defaults(args, world_size: int):
    """The defaults that follow from other flags (the batch, the positions, the schedule, the NaN check)."""
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * world_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    check_fields(args, _WARMUP_RULES)
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    elif args.lr_warmup_iters is None:
        args.lr_warmup_iters = 0
    if args.check_for_nan_in_loss_and_grad is None:  # Megatron's default, off where fp16 overflows are normal
        args.check_for_nan_in_loss_and_grad = not (args.fp16 and args.loss_scale is None)


def _check_data_parallel(args, world_size: int):
    """The global batch against the ranks, and the optimizer instances; sets data_parallel_size and
    num_micro_batches."""
    per_step = args.micro_batch_size * world_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {world_size} = {per_step}")
    args.data_parallel_size = world_size
    instances = args.num_distributed_optimizer_instances
    if isinstance(instances, int) and instances >= 1:  # smaller: the DDP config's error (check_configs)
        try:
            DataParallelTopology(world_size, instances)  # the rule's one home; its message names fields
        except ValueError:
            raise ValueError(f"--num-distributed-optimizer-instances {instances} does not divide the "
                             f"data-parallel size {world_size}: each instance needs the same number of ranks") from None
    args.num_micro_batches = args.global_batch_size // per_step


def _fill_device_and_outputs(args):
    """--device and --distributed-backend from what the machine has; --metrics-file beside the event files or
    the checkpoints."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    if args.metrics_file is None and (args.tensorboard_dir or args.save):
        args.metrics_file = os.path.join(args.tensorboard_dir or args.save, "metrics.jsonl")


# validate_args's checks of the flags that are no config field, in the order it runs them (config_checks.py).
_REQUIRED_RULES = ((
    ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "lr", "micro_batch_size", "train_iters"),
    (Check(lambda v: v is not None, "{flag} is required with --model-preset none"),)),)
_WARMUP_RULES = (
    (None, (Check(lambda a: a.lr_warmup_iters is None or a.lr_warmup_fraction is None,
                  "--lr-warmup-iters and --lr-warmup-fraction are mutually exclusive"),)),
    ("lr_warmup_fraction", (Check(lambda v: v is None or 0.0 <= v <= 1.0, "{flag} must be in [0, 1], got {value}"),)),
)
_RUN_RULES = (
    ("distributed_timeout_minutes", (Check(lambda v: math.isfinite(v) and not v <= 0,
                                           "{flag} must be a positive number, got {value}"),)),
    (("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "log_interval", "eval_interval"),
     (Check(lambda v: not v <= 0, "{flag} must be > 0, got {value}"),)),
    (None, (Check(lambda a: not a.seq_length > a.max_position_embeddings,
                  "--seq-length {config.seq_length} exceeds --max-position-embeddings "
                  "{config.max_position_embeddings}"),)),
)
_EVAL_RULES = (("eval_iters", (Check(lambda v: not v < 0, "{flag} must be >= 0, got {value}"),)),)
_DEVICE_RULES = ((None, (
    Check(lambda a: not (a.device == "cuda" and not torch.cuda.is_available()),
          "--device cuda requested but CUDA is not available"),
    Check(lambda a: not (a.distributed_backend == "nccl" and (a.device == "cpu" or not torch.cuda.is_available())),
          "--distributed-backend nccl needs CUDA tensors: use gloo on CPU"),
)),)
_OUTPUT_RULES = (
    ("tensorboard_dir", (Check(lambda v: not (v and os.path.exists(v) and not os.path.isdir(v)),
                               "{flag} {value} is not a directory: give the directory to write the event files "
                               "(and metrics.jsonl) to"),)),
    # rank 0 alone would fail to open a directory, after start-up
    ("metrics_file", (Check(lambda v: not (v and os.path.isdir(v)),
                            "{flag} {value} is a directory: name the JSONL file to write"),)),
)
