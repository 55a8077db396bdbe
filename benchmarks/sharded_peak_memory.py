"""Peak memory per rank of megatron-lite's ZeRO-3 against FSDP2 and torch DDP: the same GPT, the same initial
weights and batches (compare_ddp_systems.py builds all three), dp=4 gloo ranks, under glibc's allocator as
`pretrain_gpt.py` users get it and with `MALLOC_MMAP_THRESHOLD_=65536` (every allocation of 64 KiB or more
mapped on its own and returned on free, so RSS follows the live tensors).

Each (allocator, system) runs in freshly spawned ranks (the environment variable only acts at process start).
Per rank, with peak_rss.py (peak RSS of a phase above the rank's RSS before the model existed):

    build        the model built, wrapped (ZeRO-3 / fully_shard / torch DDP) and its optimizer created
    held         RSS at the end of the build (what stays: 4/d B/param of parameter shards for the sharded ones)
    first iter   the first training step (forward, backward, gradient sync, AdamW step)
    steady       the next --steps - 1 steps

The table gives the largest rank's MiB. Results: docs/sharding_strategies.md ("Peak memory against FSDP2")::

    python -m benchmarks.sharded_peak_memory                 # GPT 20M, dp=4, both allocators (~4 min, 2 cores)
    python -m benchmarks.sharded_peak_memory --size 80m
    python -m benchmarks.sharded_peak_memory --size tiny --allocator glibc --world-size 2   # smoke test
"""

import argparse
import json
import os
import tempfile
import time
import warnings
from types import SimpleNamespace

from benchmarks import peak_rss
from benchmarks.launch import launch

MiB = 2 ** 20
SIZES = {  # GPT shapes (tied embeddings): parameters about 20M, 80M, and a small one for the smoke test
    "20m": dict(num_layers=5, hidden_size=512, num_attention_heads=8, vocab_size=8192),
    "80m": dict(num_layers=11, hidden_size=768, num_attention_heads=12, vocab_size=8192),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=256),
}
SYSTEMS = ("ml-zero3", "fsdp2", "torch-ddp")
ALLOCATORS = {"glibc": None, "mmap64k": "65536"}  # MALLOC_MMAP_THRESHOLD_ of the spawned ranks


def build(name, args, device):
    """One of SYSTEMS (compare_ddp_systems.py); ZeRO-3 with the library's defaults (one unit per layer)."""
    from benchmarks.compare_ddp_systems import build_fsdp2, build_ml, build_torch

    if name == "ml-zero3":
        return build_ml(args, device, strategy="optim_grads_params", name=name)
    return build_fsdp2(args, device) if name == "fsdp2" else build_torch(args, device)


def measure(args, rank, world, device):
    """This rank's peaks (bytes above its baseline) for args.system; rank 0 appends every rank's to args.out."""
    from benchmarks.compare_ddp_systems import batch
    from megatron_lite.distributed import collectives

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    baseline = peak_rss.rss()
    with peak_rss.phase() as peak:
        system = build(args.system, args, device)
    peaks = {"build": peak.bytes, "held": peak_rss.rss()}
    with peak_rss.phase() as peak:
        system.step(*batch(args, 0, rank, device))
    peaks["first iter"] = peak.bytes
    with peak_rss.phase() as peak:
        for step in range(1, args.steps):
            system.step(*batch(args, step, rank, device))
    peaks["steady"] = peak.bytes
    everyone = collectives.all_gather_object({k: v - baseline for k, v in peaks.items()})
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(dict(allocator=args.allocator, system=args.system, peaks=everyone)) + "\n")


def run(args, allocator: str, system: str):
    """Spawn the ranks for one (allocator, system) with the allocator's environment."""
    value = ALLOCATORS[allocator]
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if value is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = value
    try:
        launch(measure, SimpleNamespace(**vars(args), allocator=allocator, system=system), args.world_size, cpu=True)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def report(results):
    """A markdown table: the largest rank's MiB per phase."""
    print("| allocator | system | build peak | held after build | first iteration | steady state |")
    print("|---|---|---|---|---|---|")
    for r in results:
        phases = ("build", "held", "first iter", "steady")
        cells = " | ".join(f"{max(rank[p] for rank in r['peaks']) / MiB:.0f}" for p in phases)
        print(f"| {r['allocator']} | {r['system']} | {cells} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="20m", help="the GPT (default: 20m)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--allocator", choices=["both", *ALLOCATORS], default="both",
                   help="glibc: its defaults; mmap64k: MALLOC_MMAP_THRESHOLD_=65536 (default: both)")
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks to spawn (default: 4)")
    p.add_argument("--steps", type=int, default=4, help="training steps: the first, then the steady state")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sample (default: 128)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="samples per rank and step (default: 2)")
    p.add_argument("--out", help="append the per-rank results as JSON lines to this file")
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    if any(s not in SYSTEMS for s in systems):
        p.error(f"--systems: {args.systems!r}: pick from {', '.join(SYSTEMS)}")
    if args.steps < 2:
        p.error("--steps: at least 2 (the first iteration, then the steady state)")
    if not peak_rss.available():
        raise SystemExit("sharded_peak_memory: needs Linux's /proc/self/clear_refs to reset the peak RSS")
    shape = SIZES[args.size]
    model_args = dict(shape, lr=1e-3, weight_decay=0.1, bucket_size=None)
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    numel = vocab * h + args.seq_length * h + layers * (12 * h * h + 13 * h) + 2 * h
    print(f"GPT {layers} layers, hidden {h}, vocab {vocab}, seq {args.seq_length}, micro-batch "
          f"{args.micro_batch_size}: {numel / 1e6:.1f}M parameters; dp={args.world_size} gloo ranks; MiB of RSS "
          f"above each rank's RSS before the model, largest rank", flush=True)
    allocators = list(ALLOCATORS) if args.allocator == "both" else [args.allocator]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sharded_peak_") as tmp:
        out = os.path.join(tmp, "results.jsonl")
        for allocator in allocators:
            for system in systems:
                run(_args(args, model_args, out), allocator, system)
        with open(out) as f:
            results = [json.loads(line) for line in f]
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    report(results)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


def _args(args, model_args, out):
    merged = {k: v for k, v in vars(args).items() if k not in ("out", "allocator", "systems")}
    return SimpleNamespace(**merged, **model_args, out=out)


if __name__ == "__main__":
    main()
