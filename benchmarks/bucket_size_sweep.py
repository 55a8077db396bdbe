"""Time a GPT training step against the DDP bucket size (overlap_grad_reduce=True).

    python -m benchmarks.bucket_size_sweep                        # spawns 2 gloo ranks (file:// rendezvous)
    torchrun --nproc-per-node 2 -m benchmarks.bucket_size_sweep   # gloo on CPU, NCCL with one GPU per rank
    python -m benchmarks.bucket_size_sweep --quick --out /tmp/sweep.png   # smoke test, seconds
    python -m benchmarks.bucket_size_sweep --predict --dp 256 --bandwidth-gbps 400 --latency-us 5   # a cluster

The plot and its table (.csv) go to a new directory benchmarks/results/<UTC time>/ (under the current directory;
git ignores it) unless --out names the plot; the figure in docs/img/ is replaced only by
--out docs/img/bucket_size_sweep.png. A progress line (steps done, time left) is printed at least every few
seconds while the configurations take turns.

Configurations, each a separately wrapped copy of the same model (same seed):
  * bucket_size=1 (one parameter per bucket), then 2^k from --min-bucket up to the first power of two
    >= the number of parameters (one bucket), all with overlap_grad_reduce=True;
  * overlap off: one bucket, reduced synchronously inside finish_grad_sync() (a reference line);
  * compute only: DDP over a one-rank group per rank, so the same hooks, buffer and optimizer but no
    traffic between ranks (a reference line; both ranks still compute at the same time).
A step is zero_grad_buffer, forward, backward, finish_grad_sync, optimizer.step. After --warmup untimed rounds,
every round (--repeats) runs each configuration for --steps timed steps, in an order rotated by one per
round, so that slow phases of a shared machine hit all configurations alike (timing.py). Each step starts
after a barrier; a sample is the slowest rank's time. Reported per configuration (medians; the table, CSV
and plot are written by bucket_size_sweep_report.py):
  step ms          the full step;
  exposed comm     the time the step waits on communication, timed inside it: finish_grad_sync() plus the
                   distributed optimizer's parameter all-gather in optimizer.step(). A sum of durations, so
                   never negative; finish_grad_sync's own local work (NaN check, scaling) is in it too, and
                   the compute-only row shows that floor;
  finish           wall time of finish_grad_sync() alone: gradient communication not hidden behind backward.
The CSV also has step_minus_compute_only_ms, signed: what communication costs the step in all (waits, launches,
cores taken from backward), but a difference of two noisy medians, negative where the noise is larger.
The recommendation is the bucket size with the smallest median step; sizes within --tie-tolerance of it
count as ties, won by the larger bucket (fewer collectives, the safer choice). See docs/bucket_size_tuning.md.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from benchmarks.bucket_size_sweep_report import COMPUTE_ONLY, OVERLAP_OFF, report, summarize
from benchmarks.gpt_step import SETTINGS, build, gpt_config, train_step
from benchmarks.launch import launch, world_size
from benchmarks.prediction import add_predict_flags, check_predict_flags, predict
from benchmarks.timing import Progress, alternate
from megatron_lite.models import GPTModel

RESULTS = os.path.join("benchmarks", "results")
"""Where a run's files go by default, relative to the current directory (.gitignore has /benchmarks/results/)."""


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (text, default, quick) in SETTINGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"{text} (default {default}, quick {quick})")
    p.add_argument("--min-bucket", type=int, default=2**13,
                   help="smallest bucket of the 2^k series, in elements (default 8192)")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1 (DDP and optimizer config): buckets are reduce-scattered, parameters all-gathered "
                        "in optimizer.step()")
    p.add_argument("--tie-tolerance", type=float, default=0.05,
                   help="step times within this fraction of the fastest count as ties (default 0.05)")
    p.add_argument("--quick", action="store_true",
                   help="use the 'quick' defaults above (tiny model, 1 round): a smoke test, not a measurement")
    p.add_argument("--out", help="plot path; the table goes next to it as .csv (default: "
                   "benchmarks/results/<UTC time>/bucket_size_sweep.png, a new directory; the committed figure: "
                   "--out docs/img/bucket_size_sweep.png; with --predict: no plot unless given)")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn when not launched by torchrun (default 2)")
    p.add_argument("--seed", type=int, default=1234, help="model and data seed")
    p.add_argument("--predict", action="store_true",
                   help="measure nothing: predict the step against the bucket size for a cluster with the calibrated "
                        "alpha-beta model (perf_model.py; flags below; docs/bucket_size_tuning.md)")
    add_predict_flags(p)
    args = p.parse_args()
    if args.predict:
        check_predict_flags(p, args)
        return args
    for name, (_, default, quick) in SETTINGS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    for name in [*SETTINGS, "min_bucket", "world_size"]:
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {int(name != 'warmup')}, got {getattr(args, name)}")
    if args.tie_tolerance < 0:
        p.error(f"--tie-tolerance must be >= 0, got {args.tie_tolerance}")
    if args.out is None:  # never over an earlier run's files (nor the committed ones in docs/img)
        args.out = os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S", time.gmtime()), "bucket_size_sweep.png")
    return args


def sweep(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    numel = sum(p.numel() for p in GPTModel(gpt_config(args)).parameters())
    one = 1 << (numel - 1).bit_length()  # the first power of two >= numel: always a single bucket
    series = [2**k for k in range(one.bit_length()) if args.min_bucket <= 2**k < one]
    # (name, bucket_size or None, overlap_grad_reduce, group)
    configs = [(f"{b}", b, True, None) for b in [1, *series]] + [(f"one bucket ({one})", one, True, None),
                                                               (OVERLAP_OFF, None, False, None),
                                                               (COMPUTE_ONLY, None, False, solo)]
    if rank == 0:
        print(f"bucket_size_sweep: building {len(configs)} configurations (a model copy and optimizer each)",
              flush=True)
    runs = [build(args, device, b, overlap, group) for _, b, overlap, group in configs]
    g = torch.Generator().manual_seed(args.seed + rank)  # each rank its own data
    tokens = torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g).to(device)
    names = [name for name, *_ in configs]
    if rank == 0:
        print(f"bucket_size_sweep: timing {args.warmup} warm-up + {args.repeats} rounds x {len(configs)} "
              f"configurations x {args.steps} steps", flush=True)
    timings = alternate(lambda k: train_step(*runs[k], tokens, device), len(configs), args.repeats, args.steps,
                        args.warmup, device, progress=Progress("bucket_size_sweep", names))
    num_buckets = [sum(len(x.buckets) for x in m.param_and_grad_buffers) for m, _ in runs]
    return summarize(names, [b for _, b, _, _ in configs], num_buckets, timings.samples), numel


def recommend(rows, tolerance):
    swept = [r for r in rows if r["config"] not in (OVERLAP_OFF, COMPUTE_ONLY)]
    best = min(r["step_ms"] for r in swept)
    choice = max((r for r in swept if r["step_ms"] <= best * (1 + tolerance)), key=lambda r: r["bucket_size"])
    ref = {r["config"]: r["step_ms"] for r in rows}
    return choice, (
        f"recommended bucket size: {choice['bucket_size']} elements "
        f"({'one bucket' if choice['num_buckets'] == 1 else str(choice['num_buckets']) + ' buckets'}): "
        f"{choice['step_ms']:.1f} ms/step, within {tolerance:.0%} of the fastest ({best:.1f} ms) and the largest such "
        f"bucket; overlap off {ref[OVERLAP_OFF]:.1f} ms, compute only {ref[COMPUTE_ONLY]:.1f} ms")


def benchmark(args, rank, world, device):
    rows, numel = sweep(args, device)
    if rank == 0:
        report(args, rows, numel, world, dist.get_backend(), recommend(rows, args.tie_tolerance))


def main():
    args = parse_args()
    if args.predict:
        predict(args)
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"bucket_size_sweep: starting {world_size(args.world_size)} ranks; output {args.out} (and .csv)",
              flush=True)
    launch(benchmark, args, args.world_size)


if __name__ == "__main__":
    main()
