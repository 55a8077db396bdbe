"""The GPT training step timed by bucket_size_sweep.py and perf_model_calibrate.py: its size flags, how it is
built and wrapped, and one step with its waits on communication (finish_grad_sync(), the distributed optimizer's
parameter all-gather) timed on their own.

`args` is the scripts' argparse namespace: the SETTINGS fields plus seed and use_distributed_optimizer.
"""

import time

import torch

from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.models import GPTConfig, GPTModel

# Model and timing flags: (help, default, default with --quick).
SETTINGS = dict(
    num_layers=("transformer layers", 4, 2),
    hidden_size=("hidden size", 256, 64),
    num_attention_heads=("attention heads", 8, 2),
    seq_length=("tokens per sequence", 64, 32),
    vocab_size=("vocabulary size", 4096, 512),
    micro_batch_size=("sequences per rank per step", 1, 2),
    repeats=("rounds over all configurations", 40, 1),
    steps=("timed steps per configuration per round", 2, 2),
    warmup=("untimed rounds (one step per configuration) before the first timed round", 2, 1),
)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpt_config(args):
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, vocab_size=args.vocab_size,
                     num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length)


def build(args, device, bucket_size, overlap, group):
    """A fresh model (same seed on every rank), wrapped, with its optimizer."""
    torch.manual_seed(args.seed)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    model = DistributedDataParallel(GPTModel(gpt_config(args)).to(device), ddp_config, data_parallel_group=group)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-4, use_distributed_optimizer=args.use_distributed_optimizer), [model])
    _time_param_gather(model, device)
    return model, optimizer


def _time_param_gather(model, device):
    """Keep the wall time of each model.start_param_sync() call in model.param_gather_seconds: the distributed
    optimizer's parameter all-gather, which its step() issues and (without overlap_param_gather) waits for."""
    start_param_sync = model.start_param_sync

    def timed(*args, **kwargs):
        sync(device)  # time the gather only, not the update kernels still queued before it
        start = time.perf_counter()
        start_param_sync(*args, **kwargs)
        sync(device)
        model.param_gather_seconds += time.perf_counter() - start
    model.start_param_sync = timed  # an instance attribute: the optimizer calls chunk.start_param_sync()
    model.param_gather_seconds = 0.0


def train_step(model, optimizer, tokens, device):
    """One step of a `build()` pair (alternate() times the whole step).

    Returns:
        [finish_grad_sync(), the parameter all-gather in optimizer.step(), their sum] in seconds: the sum is
        the time the step waits on communication (a sum of durations: never negative).
    """
    model.zero_grad_buffer()
    model.param_gather_seconds = 0.0
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    sync(device)  # with NCCL, wait() only orders streams: time finish_grad_sync on a drained device
    finish_start = time.perf_counter()
    model.finish_grad_sync()
    sync(device)
    finish = time.perf_counter() - finish_start
    optimizer.step()
    return [finish, model.param_gather_seconds, finish + model.param_gather_seconds]
