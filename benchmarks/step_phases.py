"""Where one training iteration's time goes: the phases of pretrain_gpt.py's step, timed apart, and the top
operators of torch.profiler, one rank (issue 24: ~10 ms of a 75 ms GPT-2 125M iteration on an H100 were
outside forward and backward, docs/performance.md).

    python -m benchmarks.step_phases                       # GPT-2 125M, bf16, per-layer compile, CUDA
    python -m benchmarks.step_phases --device cpu --quick  # a few seconds on a CPU

The step is train_step's, without the data loader: zero_grad_buffer + optimizer.zero_grad, forward and
backward of each micro-batch (the last one launching the grad reduction), finish_grad_sync, optimizer.step
(fp32 main params, fused AdamW, the bf16 copy back). Each phase is timed wall-clock between device
synchronizes (so the phases add up to more than an unsynchronized step), median of --steps steps after
--warmup; then one more step under torch.profiler, its operators by device time (CPU time on a CPU).
"""

import contextlib
import time

import torch

from benchmarks.gpt_step import sync
from benchmarks.launch import launch
from benchmarks.sized_args import parse_sized, sized_parser, write_json
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.models import GPTConfig, GPTModel

SIZES = dict(layers=(12, 2), hidden=(768, 64), heads=(12, 2), seq=(1024, 32), vocab=(50304, 512),
             micro_batch=(32, 2), micro_batches=(1, 2), steps=(10, 2), warmup=(8, 1), top=(25, 10))
"""Flag: (default, default with --quick)."""


def benchmark(args, rank, world, device):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       vocab_size=args.vocab, max_position_embeddings=args.seq, params_dtype=dtype)
    torch.manual_seed(0)
    model = GPTModel(config).to(device)
    if not args.eager:
        model.compile_layers()
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float32, overlap_grad_reduce=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=dtype == torch.bfloat16), [ddp])
    tokens = torch.randint(args.vocab, (args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step(times=None):
        marks = [time.perf_counter()]

        def mark():
            if times is not None:
                sync(device)
                marks.append(time.perf_counter())
        ddp.zero_grad_buffer()
        opt.zero_grad()
        mark()
        for m in range(args.micro_batches):
            with ddp.no_sync() if m < args.micro_batches - 1 else contextlib.nullcontext():  # as train_step
                (ddp(inputs, labels=labels).mean() / args.micro_batches).backward()
        mark()
        ddp.finish_grad_sync()
        mark()
        opt.step()
        mark()
        if times is not None:
            for name, start, end in zip(PHASES, marks, marks[1:]):
                times.setdefault(name, []).append(1e3 * (end - start))

    for _ in range(args.warmup):
        step()
    sync(device)
    times = {}
    for _ in range(args.steps):
        step(times)
    medians = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=args.top, max_name_column_width=60)
    total = sum(medians.values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.dtype}, "
          f"{'eager' if args.eager else 'per-layer compile'}, {args.micro_batches} micro-batch(es) of "
          f"{args.micro_batch} x {args.seq} on {where}")
    print(f"{'phase':28s} {'median ms':>10s} {'share':>7s}")
    for name in PHASES:
        print(f"{name:28s} {medians[name]:10.2f} {100 * medians[name] / total:6.1f}%")
    print(f"{'sum (synchronized phases)':28s} {total:10.2f}\n\ntorch.profiler, one step, by {sort_by}:\n{table}")
    write_json(args.out, dict(medians_ms=medians, eager=args.eager, micro_batches=args.micro_batches,
                              micro_batch=args.micro_batch, profile=table))


PHASES = ("zero grads", "forward + backward", "finish_grad_sync", "optimizer.step")


def main():
    p = sized_parser(__doc__, SIZES)
    p.add_argument("--eager", action="store_true", help="no torch.compile (default: per layer, as --torch-compile)")
    args, cpu = parse_sized(p, SIZES)
    launch(benchmark, args, 1, cpu=cpu, threads_per_rank=None if cpu else 1)


if __name__ == "__main__":
    main()
