"""megatron_lite's data parallelism against PyTorch's: one GPT, five systems, one run.

Every system trains the same GPTModel (same initial weights; the same synthetic global batch per step,
each rank its own slice; AdamW with the same hyperparameters and weight-decay groups; no clipping):
  ml-ddp          megatron_lite DDP (overlap_grad_reduce, --bucket-size) + FP32Optimizer
  ml-ddp+distopt  the same with the distributed optimizer and overlap_param_gather
  torch-ddp       torch DDP (bucket_cap_mb 25, gradient_as_bucket_view) + AdamW
  torch-ddp+zero  torch DDP + ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view)
  fsdp2           fully_shard on every transformer layer, then on the root + AdamW
Timing alternates: after --warmup-steps per system, each of --repeats rounds runs --steps steps of every
system in a rotated order (by default 30 rounds of 1 step, so each system's samples span the whole run);
each step starts after a barrier and counts as its slowest rank's time. One extra step per system then
runs with torch.distributed's Python collectives wrapped to count their bytes (torch DDP's C++ reducer
bypasses Python: its all-reduce is computed from its bucket sizes, and marked so).
Memory per rank: on CUDA the peak allocated during the system's steps; on CPU the model-state bytes
(params + grads + optimizer state the rank holds, shared storage counted once). Results and discussion:
docs/performance.md::

    torchrun --nproc-per-node 2 benchmarks/compare_ddp.py --overlap-study
    python benchmarks/compare_ddp.py --overlap-study       # spawns 2 ranks itself (file:// rendezvous)
    python benchmarks/compare_ddp.py --tiny                 # smoke test
"""

import argparse
import contextlib
import csv
import inspect
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from launch import launch, world_size  # noqa: E402  (benchmarks/launch.py)
from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron_lite import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_lite.distributed import collectives as ml_collectives  # noqa: E402
from megatron_lite.models import GPTConfig, GPTModel  # noqa: E402

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=256,
            micro_batch_size=2, steps=2, warmup_steps=1, repeats=1)
MIB = 2**20


@dataclass
class System:
    name: str
    step: Callable  # (x, y) -> this rank's loss: one full training step
    tensors: Callable  # () -> (params, grads, optimizer state) this rank holds
    flush: Callable = lambda: None  # finish deferred communication (distopt's parameter all-gathers)
    torch_ddp: Optional[torch.nn.Module] = None  # torch DDP, whose C++ reducer all-reduces unseen by Python


def make_model(args, device):
    torch.manual_seed(0)  # the same initial weights on every rank and for every system
    return GPTModel(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                              num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                              max_position_embeddings=args.seq_length)).to(device)


def param_groups(model):
    """get_megatron_optimizer's rule, for the torch systems too: no weight decay on biases and 1-D params."""
    no_wd = {p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1}
    return [{"params": [p for p in model.parameters() if p not in no_wd]},
            {"params": [p for p in model.parameters() if p in no_wd], "weight_decay": 0.0}]


def adamw(args, device):
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}  # what megatron_lite picks too
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay, **kernel)


def state_of(opt):
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


def build_ml(args, device, distopt=False, overlap=True, group=None, name="ml-ddp"):
    ddp = DistributedDataParallel(make_model(args, device), DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=args.bucket_size, use_distributed_optimizer=distopt,
        overlap_param_gather=distopt), data_parallel_group=group)
    opt = get_megatron_optimizer(OptimizerConfig(  # clip_grad=0: no clipping (the norm is still computed)
        lr=args.lr, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=0.0, use_distributed_optimizer=distopt), [ddp])

    def step(x, y):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x, y).mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss.detach()

    params = list(ddp.module.parameters())
    main = [p for g in opt.param_groups for p in g["params"]]  # distopt: views into the param buffer
    return System(name, step, lambda: (params + main, [p.main_grad for p in params], state_of(opt.optimizer)),
                  flush=ddp.finish_param_sync)


def build_torch(args, device, zero=False):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model(args, device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if zero:
        opt = ZeroRedundancyOptimizer(param_groups(model), optimizer_class=torch.optim.AdamW,
                                      parameters_as_bucket_view=True, **adamw(args, device))
    else:
        opt = torch.optim.AdamW(param_groups(model), **adamw(args, device))
    params = list(model.parameters())
    return System("torch-ddp+zero" if zero else "torch-ddp", plain_step(ddp, opt),
                  lambda: (params, [p.grad for p in params], state_of(opt.optim if zero else opt)), torch_ddp=ddp)


def build_fsdp2(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = make_model(args, device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model), **adamw(args, device))
    params = list(model.parameters())  # DTensors: the rank holds .to_local()
    return System("fsdp2", plain_step(model, opt), lambda: (params, [p.grad for p in params], state_of(opt)))


def plain_step(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y).mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def held_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (DTensors: their local shard)."""
    total = 0
    for t in tensors:
        storage = None if t is None else (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "_all_gather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
               "_reduce_scatter_base")


@contextlib.contextmanager
def count_collectives(world):
    """Wrap torch.distributed's Python collectives, and megatron_lite's import-time aliases of two of them;
    yields a list of (name, full message bytes, algorithmic bytes per rank) per call: all-reduce 2(N-1)/N x
    size, the others (N-1)/N x full size. (torch's deprecated names call the new ones inside
    distributed_c10d, not through the wrapped attributes, so no call is counted twice.)"""
    calls, saved = [], []

    def wrap(name, fn):
        arg = 1 if "reduce_scatter" in name else 0  # the full-size argument: RS input, AG output (or list)
        factor = (2 if name == "all_reduce" else 1) * (world - 1) / world
        keyword = list(inspect.signature(fn).parameters)[arg]

        def wrapped(*a, **kw):
            t = a[arg] if len(a) > arg else kw[keyword]
            size = sum(x.numel() * x.element_size() for x in (t if isinstance(t, (list, tuple)) else [t]))
            calls.append((name, size, factor * size))
            return fn(*a, **kw)
        return wrapped

    targets = [(dist, n, n) for n in COLLECTIVES] + [
        (ml_collectives, "_" + n, n) for n in ("reduce_scatter_single", "all_gather_single")]
    for module, attr, name in targets:
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, wrap(name, getattr(module, attr)))
    try:
        yield calls
    finally:
        for module, attr, fn in reversed(saved):
            setattr(module, attr, fn)


def batch(args, step, rank, device):
    """This rank's rows of step `step`'s global batch of random tokens (the same for every system)."""
    g = torch.Generator().manual_seed(1000 + step)
    mbs = args.micro_batch_size
    tokens = torch.randint(args.vocab_size, (dist.get_world_size() * mbs, args.seq_length + 1), generator=g)
    mine = tokens[rank * mbs:(rank + 1) * mbs].to(device)
    return mine[:, :-1], mine[:, 1:]


def run_alternating(systems, args, rank, device):
    """Warm-up round, then --repeats rounds of --steps steps per system, rotating who goes first.
    Returns step times [system, sample] (slowest rank), local losses [system, step] and, on CUDA, the
    largest rise of allocated memory during each system's steps."""
    n, cuda = len(systems), device.type == "cuda"
    times = torch.zeros(n, args.repeats * args.steps)
    losses = torch.zeros(n, args.warmup_steps + args.repeats * args.steps)
    rise, done = [0] * n, [0] * n
    for r, (steps, timed) in enumerate([(args.warmup_steps, False)] + [(args.steps, True)] * args.repeats):
        for k in [(r + i) % n for i in range(n)]:
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(steps):  # distopt's deferred all-gathers wait, unsent, for its next forward
                x, y = batch(args, done[k], rank, device)
                dist.barrier()
                start = time.perf_counter()
                losses[k, done[k]] = systems[k].step(x, y).float().cpu()
                if cuda:
                    torch.cuda.synchronize()
                if timed:
                    times[k, done[k] - args.warmup_steps] = time.perf_counter() - start
                done[k] += 1
            if cuda:
                rise[k] = max(rise[k], torch.cuda.max_memory_allocated() - base)
    times = times.to(device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return times.cpu(), losses.to(device), rise


def measure(systems, args, rank, world, device):
    """One row per system (memory per rank gathered from all ranks), and the global-batch losses."""
    times, losses, rise = run_alternating(systems, args, rank, device)
    dist.all_reduce(losses)
    losses = losses.cpu() / world
    rows = []
    for k, s in enumerate(systems):
        s.flush()  # the last timed step's deferred all-gathers must not be counted in the next one
        with count_collectives(world) as calls:  # one extra, instrumented step
            s.step(*batch(args, losses.shape[1], rank, device))
            s.flush()
        method = "counted"
        if s.torch_ddp is not None:  # one all-reduce per bucket (rebuilt in gradient order after step 1)
            log = s.torch_ddp._get_ddp_logging_data()
            buckets = [int(b) for b in (log.get("rebuilt_bucket_sizes") or log["bucket_sizes"]).split(",")]
            calls = calls + [("all_reduce (C++ reducer)", b, 2 * (world - 1) / world * b) for b in buckets]
            method = f"Python calls counted; DDP's all-reduce analytic from its bucket bytes {buckets}"
        seen, (params, grads, state) = set(), s.tensors()
        held = [held_bytes(params, seen), held_bytes(grads, seen), held_bytes(state, seen)]
        mem = [None] * world
        dist.all_gather_object(mem, (sum(held), held[2], sum(held) + rise[k] if device.type == "cuda" else None))
        names = [c[0] for c in calls]
        rows.append(dict(
            system=s.name, median_step_ms=statistics.median(times[k].tolist()) * 1e3,
            model_state_bytes_per_rank=[m[0] for m in mem], optimizer_state_bytes_per_rank=[m[1] for m in mem],
            peak_bytes_per_rank=[m[2] for m in mem], comm_bytes_per_rank_per_step=sum(c[2] for c in calls),
            message_bytes_per_step=sum(c[1] for c in calls), comm_method=method,
            collectives="; ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names))))
    K, t_torch = min(args.compare_steps, losses.shape[1]), rows[2]["median_step_ms"]  # rows[2]: torch-ddp
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
    t_ov, t_no, t_comp = [statistics.median(t.tolist()) * 1e3 for t in run_alternating(study, args, rank, device)[0]]
    hidden = (t_no - t_ov) / (t_no - t_comp) if t_no > t_comp else None  # None: noise above the comm time
    return dict(overlap_ms=t_ov, no_overlap_ms=t_no, compute_only_ms=t_comp, hidden_fraction=hidden)


def trace(args, system, rank, device):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) as p:
        for i in range(3):
            system.step(*batch(args, i, rank, device))
    os.makedirs(args.trace, exist_ok=True)
    p.export_chrome_trace(os.path.join(args.trace, f"compare_ddp_ml-ddp_rank{rank}.json"))


def machine(args, device, numel):
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return dict(torch=torch.__version__, backend=dist.get_backend(), world_size=dist.get_world_size(),
                device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
                cpus=os.cpu_count(), threads_per_rank=torch.get_num_threads(), parameters=numel,
                config={k: v for k, v in vars(args).items() if k not in ("out_dir", "trace")})


def report(args, info, rows, losses, overlap):
    cuda = info["device"] == "cuda"
    mem_key, mem = ("peak_bytes_per_rank", "peak MiB/rank") if cuda else ("model_state_bytes_per_rank",
                                                                         "model-state MiB/rank")
    print(f"{info['backend']}, {info['world_size']} ranks, torch {info['torch']}, {info['device_name']} "
          f"({info['cpus']} CPUs, {info['threads_per_rank']} thread/rank); GPT, {info['parameters']:,} parameters; "
          f"median of {args.repeats} x {args.steps} steps per system ({args.warmup_steps} warm-up), alternating\n")
    print(f"| system          | step ms | / torch-ddp | {mem} | opt-state MiB/rank | comm MB/rank/step | "
          f"loss diff vs ml-ddp |\n|-----------------|---------|-------------|{'-' * (len(mem) + 2)}|"
          f"--------------------|-------------------|---------------------|")
    for r in rows:
        print(f"| {r['system']:<15} | {r['median_step_ms']:>7.1f} | {r['ratio_to_torch_ddp']:>10.2f}x | "
              f"{max(r[mem_key]) / MIB:>{len(mem)}.2f} | {max(r['optimizer_state_bytes_per_rank']) / MIB:>18.2f} | "
              f"{r['comm_bytes_per_rank_per_step'] / 1e6:>17.2f} | {r['loss_max_abs_diff_vs_ml_ddp']:>19.2e} |")
    print("\nCollectives of one step (algorithmic bytes per rank: all-reduce 2(N-1)/N x size, the others "
          "(N-1)/N x full size):")
    for r in rows:
        print(f"  {r['system']:<15} {r['collectives']}  [{r['comm_method']}]")
    agree = all(r["losses_agree"] for r in rows)
    print(f"\nlosses of the first {losses.shape[1]} steps agree with ml-ddp within {args.loss_tol:g}: {agree}")
    if overlap:
        hidden = "n/a" if overlap["hidden_fraction"] is None else f"{100 * overlap['hidden_fraction']:.0f}%"
        print(f"\nOverlap study (ml-ddp, bucket_size {args.bucket_size:,} elements): overlap "
              f"{overlap['overlap_ms']:.1f} ms, no overlap {overlap['no_overlap_ms']:.1f} ms, compute only "
              f"{overlap['compute_only_ms']:.1f} ms -> hidden fraction of communication {hidden}"
              + ("" if cuda else "\n(CPU/gloo: gloo's threads compete with compute for the same cores)"))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "compare_ddp.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: " ".join("" if x is None else str(x) for x in v).strip() if isinstance(v, list) else v
                          for k, v in r.items()} for r in rows)  # per-rank lists: space-separated
    with open(os.path.join(args.out_dir, "compare_ddp.json"), "w") as f:
        json.dump(dict(machine=info, systems=rows, overlap_study=overlap, losses_agree=agree,
                       losses={r["system"]: losses[k].tolist() for k, r in enumerate(rows)}), f, indent=2)
    plot(args, info, rows, mem_key, mem)
    print(f"\nwrote compare_ddp.csv and compare_ddp.json to {args.out_dir}")


def plot(args, info, rows, mem_key, mem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: compare_ddp.png skipped")
        return
    names = [r["system"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar_label(ax1.bar(names, [r["median_step_ms"] for r in rows]),
                  [f"{r['ratio_to_torch_ddp']:.2f}x" for r in rows])
    ax1.set_ylabel("median step time, ms (label: / torch-ddp)")
    totals = [max(r[mem_key]) / MIB for r in rows]
    ax2.bar(names, totals, label=mem.split(" MiB")[0])
    ax2.bar(names, [max(r["optimizer_state_bytes_per_rank"]) / MIB for r in rows], label="of which optimizer state")
    ax2.set(ylabel=mem, ylim=(0, 1.3 * max(totals)))
    ax2.legend(ncol=2)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"GPT {info['parameters']:,} parameters, {info['world_size']} ranks, {info['backend']}, "
                 f"{info['device_name']}, torch {info['torch']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "compare_ddp.png"), dpi=120)
    print(f"wrote compare_ddp.png to {args.out_dir}")


def benchmark(args, rank, world, device):
    numel = sum(p.numel() for p in make_model(args, device).parameters())
    args.bucket_size = args.bucket_size or max(1, numel // 4)
    systems = [build_ml(args, device), build_ml(args, device, distopt=True, name="ml-ddp+distopt"),
               build_torch(args, device), build_torch(args, device, zero=True), build_fsdp2(args, device)]
    rows, losses = measure(systems, args, rank, world, device)
    overlap = overlap_study(args, rank, device) if args.overlap_study else None
    if args.trace:
        trace(args, systems[0], rank, device)
    if rank == 0:
        report(args, machine(args, device, numel), rows, losses, overlap)


def run(rank, args, world, init_method):
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # 2 cores, 2 ranks: more threads per rank only oversubscribe
    # GPTModel returns losses.view(b, s); only .mean() is applied to it, never an in-place op.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        benchmark(args, rank, world, device)
    finally:
        dist.destroy_process_group()


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
    world = world_size(args.world_size)
    if "RANK" not in os.environ and torch.cuda.is_available() and not args.cpu and torch.cuda.device_count() < world:
        p.error(f"{world} ranks need {world} GPUs, found {torch.cuda.device_count()} (or pass --cpu)")
    launch(run, args, world)


if __name__ == "__main__":
    main()
