"""megatron_lite's data parallelism against PyTorch's: one GPT, five systems, one run.

Every system trains the same GPTModel (same initial weights; the same synthetic global batch per step,
each rank its own slice; AdamW with the same hyperparameters and weight-decay groups; no clipping):
ml-ddp, ml-ddp+distopt, ml-zero2, ml-zero3 (megatron_lite), torch-ddp, torch-ddp+zero
(ZeroRedundancyOptimizer), fsdp2
(compare_ddp_systems.py builds them). Timing alternates (timing.py): after --warmup-steps rounds, each of
--repeats rounds runs --steps steps of every system in a rotated order (by default 30 rounds of 1 step, so
each system's samples span the whole run); each step starts after a barrier and counts as its slowest
rank's time. One extra step per system then runs with its collectives counted (counting.py:
megatron_lite's through `collectives.observe`, torch's by wrapping torch.distributed; torch DDP's C++
reducer bypasses Python: its all-reduce is computed from its bucket sizes, and marked so).
Memory per rank: on CUDA the peak allocated during the system's steps; on CPU the model-state bytes
(params + grads + optimizer state the rank holds, shared storage counted once). Results and discussion:
docs/performance.md::

    torchrun --nproc-per-node 2 -m benchmarks.compare_ddp --overlap-study
    python -m benchmarks.compare_ddp --overlap-study       # spawns 2 ranks itself (file:// rendezvous)
    python -m benchmarks.compare_ddp --tiny                 # smoke test
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist

from benchmarks.compare_ddp_report import machine, report
from benchmarks.compare_ddp_systems import batch, build_all, build_candidates, build_ml, make_model
from benchmarks.counting import algorithmic_bytes, model_state_bytes
from benchmarks.launch import launch, world_size
from benchmarks.timing import alternate
from megatron_lite.distributed import collectives

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=256,
            micro_batch_size=2, steps=2, warmup_steps=1, repeats=1)


def train_alternating(systems, args, rank, device):
    """--warmup-steps untimed and --repeats x --steps timed steps of every system, alternating; returns the
    Timings and this rank's losses [system, step]."""
    losses = torch.zeros(len(systems), args.warmup_steps + args.repeats * args.steps)
    done = [0] * len(systems)

    def step(k, x, y):  # distopt's deferred all-gathers wait, unsent, for its next forward
        losses[k, done[k]] = systems[k].step(x, y).float().cpu()
        done[k] += 1

    timings = alternate(step, len(systems), args.repeats, args.steps, args.warmup_steps, device,
                        prepare=lambda k: batch(args, done[k], rank, device))
    return timings, losses


def count_one_step(system, args, rank, world, device, step_index):
    """The collectives of one extra, instrumented step: (calls, how they were counted)."""
    system.flush()  # the last timed step's deferred all-gathers must not be counted in this one
    with system.count_collectives() as calls:
        system.step(*batch(args, step_index, rank, device))
        system.flush()
    if system.torch_ddp is None:
        return calls, "counted"
    # torch DDP: one all-reduce per bucket (rebuilt in gradient order after step 1)
    log = system.torch_ddp._get_ddp_logging_data()
    buckets = [int(b) for b in (log.get("rebuilt_bucket_sizes") or log["bucket_sizes"]).split(",")]
    calls = calls + [("all_reduce (C++ reducer)", b, algorithmic_bytes("all_reduce", b, world)) for b in buckets]
    return calls, f"Python calls counted; DDP's all-reduce analytic from its bucket bytes {buckets}"


def measure(systems, args, rank, world, device):
    """One row per system (memory per rank gathered from all ranks), and the global-batch losses."""
    timings, losses = train_alternating(systems, args, rank, device)
    losses = losses.to(device)
    dist.all_reduce(losses)  # NCCL reduces device tensors only
    losses = losses.cpu() / world
    rows = []
    for k, s in enumerate(systems):
        calls, method = count_one_step(s, args, rank, world, device, losses.shape[1])
        held = model_state_bytes(*s.tensors())
        peak = sum(held) + timings.peak_rise_bytes[k] if device.type == "cuda" else None
        mem = collectives.all_gather_object((sum(held), held[2], peak))
        names = [c[0] for c in calls]
        rows.append(dict(
            system=s.name, median_step_ms=timings.median_ms(k),
            model_state_bytes_per_rank=[m[0] for m in mem], optimizer_state_bytes_per_rank=[m[1] for m in mem],
            peak_bytes_per_rank=[m[2] for m in mem], comm_bytes_per_rank_per_step=sum(c[2] for c in calls),
            message_bytes_per_step=sum(c[1] for c in calls), comm_method=method,
            collectives="; ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names))))
    K = min(args.compare_steps, losses.shape[1])
    t_torch = next(row["median_step_ms"] for row in rows if row["system"] == "torch-ddp")
    for k, row in enumerate(rows):
        row["ratio_to_torch_ddp"] = row["median_step_ms"] / t_torch
        row["loss_max_abs_diff_vs_ml_ddp"] = (losses[k, :K] - losses[0, :K]).abs().max().item()
        row["losses_agree"] = row["loss_max_abs_diff_vs_ml_ddp"] <= args.loss_tol
    return rows, losses[:, :K]


def overlap_study(args, rank, device):
    """ml-ddp with overlap, without, and with no communication at all (each rank a 1-rank group)."""
    solo, _ = dist.new_subgroups(group_size=1)
    study = [build_ml(args, device), build_ml(args, device, overlap=False, name="no overlap"),
             build_ml(args, device, group=solo, name="compute only")]
    t_ov, t_no, t_comp = [train_alternating(study, args, rank, device)[0].median_ms(k) for k in range(3)]
    hidden = (t_no - t_ov) / (t_no - t_comp) if t_no > t_comp else None  # None: noise above the comm time
    return dict(overlap_ms=t_ov, no_overlap_ms=t_no, compute_only_ms=t_comp, hidden_fraction=hidden)


def trace(args, system, rank, device):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) as p:
        for i in range(3):
            system.step(*batch(args, i, rank, device))
    os.makedirs(args.trace, exist_ok=True)
    p.export_chrome_trace(os.path.join(args.trace, f"compare_ddp_ml-ddp_rank{rank}.json"))


def benchmark(args, rank, world, device):
    # GPTModel returns losses.view(b, s); only .mean() is applied to it, never an in-place op.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    numel = sum(p.numel() for p in make_model(args, device).parameters())
    args.bucket_size = args.bucket_size or max(1, numel // 4)
    systems = build_all(args, device)
    if args.candidates:
        systems[4:4] = build_candidates(args, device)  # before the torch systems
    rows, losses = measure(systems, args, rank, world, device)
    overlap = overlap_study(args, rank, device) if args.overlap_study else None
    if args.trace:
        trace(args, systems[0], rank, device)
    if rank == 0:
        report(args, machine(args, device, numel), rows, losses, overlap)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in [
        ("num-layers", 6, "transformer layers"), ("hidden-size", 256, "hidden size (6,868,992 parameters with "
                                                   "the defaults)"),
        ("num-attention-heads", 4, "attention heads"), ("seq-length", 128, "tokens per sample"),
        ("vocab-size", 8192, "vocabulary size"), ("micro-batch-size", 2, "samples per rank and step"),
        ("steps", 1, "timed steps per system in each round"), ("warmup-steps", 2, "untimed steps per system first"),
        ("repeats", 30, "timed rounds (the systems take turns within each, in a rotated order)"),
        ("compare-steps", 10, "K: compare the losses of the first K steps"),
        ("world-size", 2, "ranks to spawn when not launched by torchrun"),
    ]:
        p.add_argument(f"--{flag}", type=int, default=default, help=f"{text} (default: {default})")
    p.add_argument("--bucket-size", type=int, help="ml-ddp bucket size in elements (default: 1/4 of the parameters)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay, none on biases and 1-D "
                   "parameters (default: 0.1)")
    p.add_argument("--loss-tol", type=float, default=1e-4, help="largest |loss - ml-ddp loss| that counts as "
                   "agreeing (default: 1e-4)")
    p.add_argument("--overlap-study", action="store_true", help="also time ml-ddp with overlap_grad_reduce, "
                   "without it, and without communication; print the hidden fraction of communication")
    p.add_argument("--candidates", action="store_true", help="also time ml-ddp and ml-ddp+distopt without "
                   "gradient_as_bucket_view and/or with the gradient norm (what each saving is worth)")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler chrome trace of 3 ml-ddp steps per rank")
    p.add_argument("--out-dir", default="benchmarks/results", help="for compare_ddp.csv/.json/.png "
                   "(default: benchmarks/results)")
    p.add_argument("--tiny", action="store_true", help="a 118,528-parameter model, 1 round of 2 steps: smoke test")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even when CUDA is available")
    args = p.parse_args()
    if args.tiny:
        vars(args).update(TINY)
    for name, value in vars(args).items():
        if isinstance(value, int) and not isinstance(value, bool) and value < (0 if name == "warmup_steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup_steps' else 1}")
    launch(benchmark, args, world_size(args.world_size), cpu=args.cpu, threads_per_rank=1)


if __name__ == "__main__":
    main()
