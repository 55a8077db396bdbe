"""What replicated optimizer state costs: bytes per parameter per rank and step time for
num_distributed_optimizer_instances R = 1, 2, 4 (at dp=4), side by side in one run.

The model and the accounting are sharding_memory.py's, from mlp_memory.py (bf16 params, fp32 grads and
main params, Adam, the distributed optimizer, overlap_grad_reduce). With R instances each shard lives on
R ranks, so a rank keeps 1/(d/R) of the fp32 main params and Adam moments: 12R/d bytes per parameter, on top
of the 6 that every rank keeps (bf16 params, fp32 grads). Step times: alternating rounds, slowest rank (timing.py). ::

    python -m benchmarks.replica_memory [--world-size 4]
"""

import os

import torch

from benchmarks.mlp_memory import MLPStack, held, run, train_step
from benchmarks.timing import alternate
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.distributed import collectives


def build(instances, args):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(MLPStack(args.hidden, args.layers).to(torch.bfloat16), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=8 * args.hidden ** 2 + 7 * args.hidden,
        use_distributed_optimizer=True, num_distributed_optimizer_instances=instances))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=True), [ddp])
    return ddp, opt


def benchmark(args, rank, world, device):
    instances = [r for r in (1, 2, 4) if world % r == 0]
    runs = [build(r, args) for r in instances]
    numel = sum(p.numel() for p in runs[0][0].param_to_name)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    y = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    timings = alternate(lambda k: [train_step(*runs[k], x, y)], len(runs), args.steps, warmup=args.warmup)
    mems = collectives.all_gather_object([held(ddp, opt) for ddp, opt in runs])
    if rank != 0:
        return
    print(f"gloo, {world} ranks on {os.cpu_count()} cores, torch {torch.__version__}; MLPStack hidden {args.hidden} x "
          f"{args.layers} blocks = {numel:,} parameters; bf16 params, fp32 grads and main params, Adam; "
          f"median of {args.steps} alternating rounds\n")
    print("| R | ranks per instance | fp32 main + Adam B/param | theory 12R/d | total B/param | theory 6 + 12R/d "
          "| step ms | / R=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for k, r in enumerate(instances):
        m = max(mems, key=lambda per_rank: per_rank[k]["main"] + per_rank[k]["state"])[k]
        optimizer_state = (m["main"] + m["state"]) / numel
        total = sum(m.values()) / numel
        print(f"| {r} | {world // r} | {optimizer_state:.2f} | {12 * r / world:.2f} | {total:.2f} | "
              f"{6 + 12 * r / world:.2f} | {timings.median_ms(k):.1f} | "
              f"{timings.median_ms(k) / timings.median_ms(0):.2f}x |")


def main():
    run(benchmark, __doc__, steps=30, ranks=4)


if __name__ == "__main__":
    main()
