"""megatron-core 0.16.1 as a reference on a CPU-only torch: what its GPTModel, DistributedDataParallel, optimizer
and dist_checkpointing need to run without CUDA, and megatron-lite's GPTConfig spelled as megatron-core's.

Use it in a *separate process* (a script the test runs with subprocess, under `if __name__ == "__main__":`):
install_cpu_stubs() patches torch process-wide, and dist_checkpointing spawns helper processes that re-import
the main module. Tests skip where megatron-core is not installed (`requires_mcore`); .ci/run installs the
`megatron` extra, so they run in CI.

The stubs, each the smallest change that lets megatron-core's CUDA-only lines run on the CPU:
  * tensors created or moved with device='cuda' (its optimizers, masks, rotary tables) are put on the CPU;
  * torch.cuda.current_device() is 'cpu', torch.cuda.synchronize() does nothing, Tensor.cuda() is the tensor;
  * Tensor.type() spells CPU types as CUDA ones (its optimizers check 'torch.cuda.FloatTensor');
  * the model-parallel RNG tracker's fork() is a no-op context (no CUDA generator to fork; dropout stays 0).
"""

import contextlib
import importlib.util
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
requires_mcore = pytest.mark.skipif(not HAVE_MCORE,
                                    reason="megatron-core is not installed (pip install -e '.[megatron]')")


def _cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if getattr(func, "__name__", "") == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_installed = []


def install_cpu_stubs():
    """Patch torch and megatron-core for a CPU run (idempotent). Call before building any megatron-core object."""
    if _installed:
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    cpu_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return cpu_type(self, *args, **kwargs)
        name = cpu_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    mode = _CudaToCpu()
    mode.__enter__()
    _installed.append(mode)


def init_world(rank: int = 0, world_size: int = 1, init_method: str = None):
    """gloo process group and megatron-core's parallel state (TP = PP = 1, DP = world_size)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    install_cpu_stubs()
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
        init_method = "env://"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(1, 1)


def transformer_config(config, **overrides):
    """megatron-core's TransformerConfig for a megatron-lite GPTConfig (fp32, no dropout unless given)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    activation = {"gelu": F.gelu, "silu": F.silu, "openai_gelu": openai_gelu}[config.activation_func]
    kwargs = dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                  num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
                  ffn_hidden_size=config.ffn_hidden_size, normalization=config.normalization,
                  gated_linear_unit=config.gated_linear_unit, activation_func=activation,
                  add_bias_linear=config.add_bias_linear, layernorm_epsilon=config.layernorm_epsilon,
                  hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
                  init_method_std=config.init_method_std, use_cpu_initialization=True,
                  bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                  apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(config, **overrides):
    """megatron-core's GPTModel (local layer spec) with megatron-lite's `config` architecture."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    install_cpu_stubs()
    tc = transformer_config(config, **overrides)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(tc, spec, vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope" if config.position_embedding_type == "rope" else "learned_absolute",
                    rotary_base=int(config.rotary_base),
                    share_embeddings_and_output_weights=config.share_embeddings_and_output_weights)


def forward(model, input_ids, labels=None):
    """megatron-core's GPTModel on [b, s] ids: logits [b, s, V], or with labels the per-token loss [b, s]. The
    causal mask is given explicitly (megatron-core's default one is built on 'cuda')."""
    b, s = input_ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return model(input_ids, positions, attention_mask=mask, labels=labels)


def run_script(script: str, *args: str, timeout: float = 300) -> dict:
    """Run a megatron-core script of tests/support in its own process (repository and tests/support on its
    path); it prints one JSON object as its last stdout line, returned here. A failure shows its output."""
    import json
    import subprocess
    import sys

    support = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(support))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, support, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, os.path.join(support, script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=repo)
    if done.returncode != 0:
        raise AssertionError(f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
