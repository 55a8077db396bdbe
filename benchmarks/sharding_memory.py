"""Model-state bytes per parameter of the four data-parallel sharding strategies, against theory, with the
transient peak next to them, and their step times side by side.

One model (benchmarks/mlp_memory.py's stack of residual MLP blocks; each block is a ZeRO-3 unit and
a bucket) is built per (dtype, strategy) on every rank, with overlap_grad_reduce and Adam: bf16 params
with fp32 gradients and main params, or fp32 throughout. After a few steps, the real bytes this rank holds
are counted (params, grads, fp32 main params, Adam state; shared storage once). Theory for d ranks
(bytes per parameter, P = 2 or 4 for the params, 4 for the fp32 grads, M = 4 for bf16's main params):

    no_shard     P + 4 + M + 8         optim               P + 4 + (M + 8)/d
    optim_grads  P + (4 + M + 8)/d     optim_grads_params  (P + 4 + M + 8)/d

i.e. fp32 16, 8 + 8/d, 4 + 12/d, 16/d; bf16 18, 6 + 12/d, 2 + 16/d, 18/d. The transient peak is the
largest amount of full-size gradients (ZeRO-2/3: buckets accumulating or in flight) plus gathered
parameters (ZeRO-3: units in use or prefetched) alive at any point of one more step, recorded from the
hooks. Step times: alternating rounds, slowest rank (timing.py). ::

    python -m benchmarks.sharding_memory [--world-size 4]
    torchrun --nproc-per-node 2 -m benchmarks.sharding_memory
"""

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

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CONFIGS = [(dtype, s) for dtype in (torch.bfloat16, torch.float32) for s in STRATEGIES]


def build(dtype, strategy, args):
    torch.manual_seed(0)
    block = 8 * args.hidden ** 2 + 7 * args.hidden
    ddp = DistributedDataParallel(MLPStack(args.hidden, args.layers).to(dtype), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=block,
        data_parallel_sharding_strategy=strategy))
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=1e-4, bf16=dtype == torch.bfloat16, use_distributed_optimizer=strategy != "no_shard"), [ddp])
    return ddp, opt


def transient_peak(ddp, opt, x, y) -> int:
    """Largest full-size gradient + gathered parameter bytes (ZeRO-2/3 storages) alive during a step."""
    buckets = [b for buf in ddp.param_and_grad_buffers for b in buf.buckets]
    if not buckets[0].shards_grads:
        return 0
    peak = [0]

    def record(*_):
        alive = sum(b.grad_data.untyped_storage().nbytes() for b in buckets)
        alive += sum(b.param_data.untyped_storage().nbytes() for b in buckets if b.shards_params)
        peak[0] = max(peak[0], alive)
    handles = [p.register_post_accumulate_grad_hook(record) for p in ddp.param_to_name]
    handles += [m.register_forward_hook(lambda *a: record()) for m in ddp.module.modules()]
    train_step(ddp, opt, x, y)
    for h in handles:
        h.remove()
    return peak[0]


def theory(dtype, strategy, d) -> float:
    p, main = (2, 4) if dtype == torch.bfloat16 else (4, 0)
    sharded = {"no_shard": 0, "optim": main + 8, "optim_grads": 4 + main + 8, "optim_grads_params": p + 4 + main + 8}
    total = p + 4 + main + 8
    return total - sharded[strategy] + sharded[strategy] / d


def benchmark(args, rank, world, device):
    runs = [build(dtype, strategy, args) for dtype, strategy in CONFIGS]
    numel = sum(p.numel() for p in runs[0][0].param_to_name)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    y = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    timings = alternate(lambda k: [train_step(*runs[k], x, y)], len(runs), args.steps, warmup=args.warmup)
    mems = collectives.all_gather_object([dict(held(ddp, opt), peak=transient_peak(ddp, opt, x, y))
                                          for ddp, opt in runs])
    if rank != 0:
        return
    print(f"{torch.distributed.get_backend()}, {world} ranks, torch {torch.__version__}; MLPStack hidden {args.hidden} "
          f"x {args.layers} blocks = {numel:,} parameters; Adam; overlap_grad_reduce, one bucket (and ZeRO-3 unit) "
          f"per block; median of {args.steps} steps\n")
    print("| dtype | strategy | params | grads | fp32 main | Adam | total B/param | theory | transient peak B/param "
          "| step ms | / optim |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, (dtype, strategy) in enumerate(CONFIGS):
        m = max(mems, key=lambda per_rank: sum(per_rank[k][key] for key in ("params", "grads", "main", "state")))[k]
        per = {key: value / numel for key, value in m.items()}
        base = CONFIGS.index((dtype, "optim"))
        print(f"| {'bf16' if dtype == torch.bfloat16 else 'fp32'} | {strategy} | {per['params']:.2f} | "
              f"{per['grads']:.2f} | {per['main']:.2f} | {per['state']:.2f} | "
              f"{per['params'] + per['grads'] + per['main'] + per['state']:.2f} | "
              f"{theory(dtype, strategy, world):.2f} | {per['peak']:.2f} | {timings.median_ms(k):.1f} | "
              f"{timings.median_ms(k) / timings.median_ms(base):.2f}x |")


def main():
    run(benchmark, __doc__)


if __name__ == "__main__":
    main()
