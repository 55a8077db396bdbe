"""The residual MLP stack measured by optimizer_memory.py, sharding_memory.py and replica_memory.py: the
model, one training step, the bytes a rank holds after it, and the flags of the latter two scripts.
"""

import argparse
import time

import torch

from benchmarks.counting import held_bytes
from benchmarks.launch import launch, world_size


class MLPStack(torch.nn.Module):
    """`layers` pre-norm residual blocks, x + W2 gelu(W1 LayerNorm(x)): 8h^2 + 7h parameters each."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def train_step(ddp, opt, x, y) -> float:
    """One full training step; returns the seconds spent in optimizer.step()."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = (ddp(x.to(ddp.param_and_grad_buffers[0].param_dtype)).float() - y).square().mean()
    loss.backward()
    ddp.finish_grad_sync()
    start = time.perf_counter()
    opt.step()  # the distributed optimizer's parameter all-gather happens in here
    return time.perf_counter() - start


def held(ddp, opt) -> dict:
    """This rank's bytes after a step, by kind (storage shared between kinds counted once)."""
    seen, buckets = set(), [b for buf in ddp.param_and_grad_buffers for b in buf.buckets]
    buffers = [buf.param_data for buf in ddp.param_and_grad_buffers if buf.param_data is not None]
    params = buffers + list(ddp.param_to_name)
    params += [b.param_shard for b in buckets if b.param_shard is not None]
    grads = [buf.grad_data for buf in ddp.param_and_grad_buffers if buf.grad_data is not None]
    grads += [b.grad_shard for b in buckets if b.grad_shard is not None] + [b.grad_data for b in buckets]
    return dict(params=held_bytes(params, seen), grads=held_bytes(grads, seen),
                main=held_bytes([p for g in opt.optimizer.param_groups for p in g["params"]], seen),
                state=held_bytes([t for s in opt.optimizer.state.values() for t in s.values()
                                  if torch.is_tensor(t) and t.dim() > 0], seen))


def run(benchmark_fn, doc: str, steps: int = 20, ranks: int = 2):
    """Parse the MLPStack flags (of sharding_memory.py and replica_memory.py) and run `benchmark_fn` on CPU ranks."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="model width h (default: 256)")
    p.add_argument("--layers", type=int, default=6, help="residual MLP blocks (default: 6)")
    p.add_argument("--micro-batch-size", type=int, default=32, help="rows of input per rank (default: 32)")
    p.add_argument("--steps", type=int, default=steps, help=f"timed rounds (default: {steps})")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    p.add_argument("--world-size", type=int, default=ranks, help=f"ranks to spawn when not launched by torchrun "
                   f"(default: {ranks})")
    args = p.parse_args()
    for flag in ("hidden", "layers", "micro_batch_size", "steps", "world_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    launch(benchmark_fn, args, world_size(args.world_size), cpu=True, threads_per_rank=1)
