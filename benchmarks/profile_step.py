"""cProfile of megatron_lite training steps on one rank: where the wrapper's own time goes.

    python -m benchmarks.profile_step [--steps 30 --top 25]

A 4-layer GPT (hidden 256, vocab 4096, 4.2M parameters) wrapped in DistributedDataParallel (overlap on,
500K-element buckets) with the FP32 Megatron optimizer, in a 1-rank gloo group. Prints the functions with
the most own time; docs/performance.md ("Hot-path profile") reads this table.
"""

import argparse
import cProfile
import pstats

import torch

from benchmarks.launch import launch
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.models import GPTConfig, GPTModel


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    launch(benchmark, p.parse_args(), 1, cpu=True, threads_per_rank=1)  # a world of one, in this process


def benchmark(args, rank, world, device):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=4096,
                               max_position_embeddings=64))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=500_000))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [ddp])
    tokens = torch.randint(0, 4096, (4, 64))

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens, labels=tokens).mean().backward()
        ddp.finish_grad_sync()
        opt.step()

    for _ in range(3):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    print(f"{len(list(model.parameters()))} parameter tensors, {sum(p.numel() for p in model.parameters())} "
          f"elements; totals below are over {args.steps} steps")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
