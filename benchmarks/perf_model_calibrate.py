"""Measure what perf_model.py needs on this machine, at one world size, and the step times it predicts.

    python -m benchmarks.perf_model_calibrate --world-size 2 --out benchmarks/results/perf_model_dp2.json

Writes a JSON with
  samples   gloo (or NCCL) all-reduce times over sizes 4 KB .. 32 MB (median of --reps, slowest rank);
  timeline  the GPT of bucket_size_sweep.py (its default size) wrapped with a one-rank group per rank (the
            same hooks and optimizer, no traffic): forward, backward and optimizer time, and when each
            parameter's gradient was ready (median of --steps steps);
  measured  the real step (overlap_grad_reduce) at several bucket sizes, alternating rounds (timing.py),
            for validating predictions made from another world size (bucket_size_sweep.py --validate).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.gpt_step import SETTINGS, build, sync, train_step
from benchmarks.launch import launch, world_size
from benchmarks.timing import alternate

SIZES = [2**k for k in range(10, 24, 2)]  # elements (fp32): 4 KB .. 32 MB
MEASURED_BUCKETS = [2**14, 2**16, 2**18, 2**20, 2**22]


def collective_samples(args, device):
    """(kind, bytes, ranks, seconds) of an all-reduce per size: median of --reps alternating rounds, slowest rank."""
    buffers = [torch.ones(n, device=device) for n in SIZES]
    timings = alternate(lambda k: dist.all_reduce(buffers[k]), len(SIZES), args.reps, 1, 1, device)
    return [("all_reduce", n * 4, dist.get_world_size(), timings.median_ms(k) / 1e3) for k, n in enumerate(SIZES)]


def timeline(args, device):
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    model, optimizer = build(args, device, None, False, solo)
    params = list(model.param_to_name)
    stamps = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
    tokens = torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(args.seed + rank)).to(device)
    runs = []
    for step in range(args.steps + 2):
        model.zero_grad_buffer()
        start = time.perf_counter()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        sync(device)
        backward_start = time.perf_counter()
        loss.backward()
        model.finish_grad_sync()
        sync(device)
        backward_end = time.perf_counter()
        optimizer.step()
        sync(device)
        runs.append((backward_start - start, backward_end - backward_start, time.perf_counter() - backward_end,
                     [stamps[i] - backward_start for i in range(len(params))]))
    runs = runs[2:]
    med = statistics.median
    return dict(forward=med(r[0] for r in runs), backward=med(r[1] for r in runs), optimizer=med(r[2] for r in runs),
                numels=[p.numel() for p in params], ready=[med(r[3][i] for r in runs) for i in range(len(params))])


def measured_steps(args, device):
    rank = dist.get_rank()
    runs = [build(args, device, b, True, None) for b in MEASURED_BUCKETS]
    tokens = torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(args.seed + rank)).to(device)
    timings = alternate(lambda k: train_step(*runs[k], tokens, device), len(runs), args.repeats, 1, 1, device)
    return {b: timings.median_ms(k) / 1e3 for k, b in enumerate(MEASURED_BUCKETS)}


def benchmark(args, rank, world, device):
    result = dict(world=world, cores=os.cpu_count(), backend=dist.get_backend(), device=str(device),
                  samples=collective_samples(args, device), timeline=timeline(args, device),
                  measured=measured_steps(args, device))
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f)
        phases = result["timeline"]
        print(f"wrote {args.out}: {world} ranks, forward {phases['forward'] * 1e3:.1f} ms, backward "
              f"{phases['backward'] * 1e3:.1f} ms, optimizer {phases['optimizer'] * 1e3:.1f} ms; "
              f"measured steps (ms) " + ", ".join(f"{b}: {s * 1e3:.1f}" for b, s in result["measured"].items()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (text, default, _) in SETTINGS.items():
        if name not in ("repeats", "steps", "warmup"):
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"{text} (default {default})")
    p.add_argument("--reps", type=int, default=7, help="all-reduce repetitions per size (default 7)")
    p.add_argument("--steps", type=int, default=10, help="steps recorded for the timeline (default 10)")
    p.add_argument("--repeats", type=int, default=15, help="alternating rounds of the measured steps (default 15)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--out", default="benchmarks/results/perf_model.json")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even when CUDA is available (default: one GPU "
                   "per rank with NCCL where there are enough GPUs, so the file holds NCCL figures)")
    args = p.parse_args()
    launch(benchmark, args, world_size(args.world_size), cpu=args.cpu, threads_per_rank=1)


if __name__ == "__main__":
    main()
