"""Python-level cost of the DDP wrapper: bare model vs megatron_lite DDP vs torch DDP, in one process.

A world of one rank makes every collective trivial, so what remains is the wrapper's own work per step:
grad hooks, bucket bookkeeping, the main_grad copies and launching (no-op) collectives. The model has
many small parameters to magnify per-parameter costs. Steps alternate between the variants and the
CPU time of the main thread is reported (less sensitive to other processes than wall time).

    python -m benchmarks.ddp_overhead [--layers 100 --width 64 --steps 50 --repeats 5]
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn

from benchmarks.launch import launch
from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=100, help="Linear+Tanh blocks (2 params each)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=50, help="timed steps per variant per repeat")
    p.add_argument("--repeats", type=int, default=5)
    launch(benchmark, p.parse_args(), 1, cpu=True, threads_per_rank=1)  # a world of one, in this process


def benchmark(args, rank, world, device):

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)])

    x = torch.randn(args.batch, args.width)
    bucket = args.width * (args.width + 1) * 10  # ~10 blocks per bucket
    variants = {}
    bare = model()
    variants["bare model"] = lambda: (bare.zero_grad(set_to_none=True), bare(x).sum().backward())
    for name, cfg in [("megatron_lite, overlap", dict(overlap_grad_reduce=True, bucket_size=bucket)),
                      ("megatron_lite, no overlap", dict())]:
        m = DistributedDataParallel(model(), DistributedDataParallelConfig(**cfg))
        variants[name] = lambda m=m: (m.zero_grad_buffer(), m(x).sum().backward(), m.finish_grad_sync())
    t = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=bucket * 4 / 2**20, gradient_as_bucket_view=True)
    variants["torch DDP"] = lambda: (t.zero_grad(set_to_none=False), t(x).sum().backward())

    cpu = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            fn = variants[name]
            for _ in range(3):
                fn()
            for _ in range(args.steps):
                t0 = time.thread_time()
                fn()
                cpu[name].append(time.thread_time() - t0)
    # The 10th percentile: on a shared machine, contention only ever adds time to a sample.
    def p10(xs):
        return statistics.quantiles(xs, n=10)[0]

    base = p10(cpu["bare model"])
    n_params = 2 * args.layers
    print(f"{n_params} parameters, {args.layers} blocks of width {args.width}, batch {args.batch}; main-thread "
          f"CPU time per step, 10th percentile of {args.repeats}x{args.steps} steps")
    print(f"{'variant':28s} {'ms/step':>8s} {'vs bare':>8s} {'overhead/param (us)':>20s}")
    for name in names:
        t = p10(cpu[name])
        print(f"{name:28s} {t * 1e3:8.3f} {t / base:7.2f}x {(t - base) / n_params * 1e6:20.2f}")


if __name__ == "__main__":
    main()
