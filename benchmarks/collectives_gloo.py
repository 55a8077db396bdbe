"""Median time of the data-parallel collectives on gloo: torch's native ones vs megatron_lite's.

For each flat fp32 bucket size, every iteration runs each operation once (in a rotating order, so no
operation always goes first) between barriers; a sample is the slowest rank's time. Ratios are to the
all-reduce of the same bucket, measured in the same run (results: docs/ddp_buffer_and_buckets.md)::

    torchrun --nproc-per-node 2 -m benchmarks.collectives_gloo --sizes 64K 1M 4M 16M --iters 20
    python -m benchmarks.collectives_gloo            # spawns 2 ranks itself (file:// rendezvous)
"""

import argparse
import os

import torch
import torch.distributed as dist

from benchmarks.launch import launch, world_size
from benchmarks.timing import alternate
from megatron_lite.distributed import collectives

# torch 2.13 names first, older names as fallback (same choice as megatron_lite.distributed.collectives).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def parse_size(text: str) -> int:
    """'64K' -> 65536, '4M' -> 4194304, '1000' -> 1000 (elements)."""
    scale = {"K": 2**10, "M": 2**20}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def make_ops(bucket: torch.Tensor, world: int, rank: int):
    """name -> zero-argument callable running one operation on `bucket` (in place where it can be)."""
    own = collectives.shard(bucket, world, rank)  # this rank's 1/world slice, a view into the bucket
    return {
        "all_reduce": lambda: dist.all_reduce(bucket),
        "native reduce-scatter": lambda: reduce_scatter_single(own, bucket),
        "lite reduce_scatter": lambda: collectives.reduce_scatter(bucket),
        "native all-gather": lambda: all_gather_single(bucket, own),
        "lite all_gather": lambda: collectives.all_gather(bucket),
    }


def check(world: int, rank: int):
    """The timed calls must be correct, in particular with an output that aliases the input."""
    n = 4 * world
    bucket = torch.empty(n)
    ops = make_ops(bucket, world, rank)

    def mine(r):  # rank r's input
        return torch.arange(n, dtype=torch.float32) + 100 * r

    reduced = collectives.shard(sum(mine(r) for r in range(world)), world, rank)
    gathered = torch.cat([collectives.shard(mine(r), world, r) for r in range(world)])
    for name, op in ops.items():
        bucket.copy_(mine(rank))
        op()
        got, want = (bucket, gathered) if "gather" in name else (collectives.shard(bucket, world, rank), reduced)
        assert torch.equal(got, want), f"{name} on rank {rank}: {got.tolist()} != {want.tolist()}"


def benchmark(args, rank: int, world: int, device):
    check(world, rank)
    rows = []
    for size in args.sizes:
        bucket = torch.empty(size, dtype=torch.float32)
        ops = list(make_ops(bucket, world, rank).items())

        def refill(k):  # the same values every time: no overflow, no denormals
            bucket.fill_(1.0)
            return ()

        def run(k):
            ops[k][1]()

        timings = alternate(run, len(ops), args.iters, warmup=args.warmup, prepare=refill)
        medians = [timings.median_ms(k) for k in range(len(ops))]
        rows += [(size, name, ms, ms / medians[0]) for (name, _), ms in zip(ops, medians)]
    if rank == 0:
        print(f"gloo, {world} ranks, torch {torch.__version__}, 1 thread/rank, {os.cpu_count()} CPUs, "
              f"fp32, median of {args.iters} iterations ({args.warmup} warm-up)\n")
        print(f"| {'elements':>10} | {'operation':<22} | {'median ms':>9} | {'/ all_reduce':>12} |")
        print(f"|{'-' * 12}|{'-' * 24}|{'-' * 11}|{'-' * 14}|")
        for size, name, ms, ratio in rows:
            print(f"| {size:>10} | {name:<22} | {ms:>9.2f} | {ratio:>11.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[2**16, 2**20, 2**22, 2**24],
                        help="bucket sizes in fp32 elements, K/M suffixes allowed (default: 64K 1M 4M 16M)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (default: 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default: 2)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn when not launched by torchrun (default: 2)")
    args = parser.parse_args()
    world = world_size(args.world_size)
    if any(size % world for size in args.sizes):
        parser.error(f"--sizes must be multiples of the world size ({world})")
    launch(benchmark, args, world, cpu=True, threads_per_rank=1)


if __name__ == "__main__":
    main()
