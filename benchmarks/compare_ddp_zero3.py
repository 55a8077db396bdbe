"""ZeRO-3's tunable gathers on compare_ddp's GPT: memory vs bytes communicated vs step time per setting.

The systems of benchmarks/compare_ddp.py that shard (ml-zero2, ml-zero3, fsdp2) next to torch DDP, plus
ml-zero3 under DistributedDataParallelConfig's gather settings: prefetch_bucket_size 0 (no prefetch), None
(one unit ahead, the default), two units' elements, everything; param_persistence_threshold 100,000
(DeepSpeed's default stage3_param_persistence_threshold: the norms, biases and the position embedding kept
whole); max_reuse_distance 0 (the last layer kept from forward to backward), two units' elements (the last
two), everything (every layer: FSDP2's reshard_after_forward=False). Same model, batches, timing and
counting as compare_ddp.py (alternating rounds, slowest rank per step, collectives counted in one extra
step). One more untimed step per megatron_lite system measures the
peak of full-size storages during a step: gathered parameters plus unreduced gradients (the buckets'
storages, sampled at every module's forward and every gradient hook; persistent parameters included).
Results: docs/sharding_strategies.md::

    python -m benchmarks.compare_ddp_zero3               # spawns 2 gloo ranks
    python -m benchmarks.compare_ddp_zero3 --tiny        # smoke test
"""

import argparse
import warnings

import torch

from benchmarks.compare_ddp import measure
from benchmarks.compare_ddp_systems import batch, build_fsdp2, build_ml, build_torch, make_model
from benchmarks.launch import launch, world_size
from megatron_lite.distributed import collectives

MIB = 2**20
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=256,
            micro_batch_size=2, warmup_steps=1, repeats=2)


def zero3_settings(unit: int):
    """(name, DistributedDataParallelConfig fields) of the ml-zero3 rows; `unit`: one layer's elements."""
    return [("ml-zero3", {}),
            ("zero3 prefetch 0", dict(prefetch_bucket_size=0)),
            ("zero3 prefetch 2u", dict(prefetch_bucket_size=2 * unit)),
            ("zero3 prefetch all", dict(prefetch_bucket_size=10 ** 12)),
            ("zero3 persist 1e5", dict(param_persistence_threshold=100_000)),
            ("zero3 reuse last", dict(max_reuse_distance=0)),
            ("zero3 reuse 2u", dict(max_reuse_distance=2 * unit)),
            ("zero3 reuse all", dict(max_reuse_distance=10 ** 12))]


def full_size_peak(system, args, rank, device) -> int:
    """Bytes of the largest full-size parameter + gradient storages alive at any hook of one step."""
    ddp = system.wrapper
    buckets = [b for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]
    peak = [0]

    def sample(*_):
        alive = sum((b.param_data.untyped_storage().nbytes() if b.shards_params else 0)
                    + (b.grad_data.untyped_storage().nbytes() if b.shards_grads else 0) for b in buckets)
        peak[0] = max(peak[0], alive)

    handles = [p.register_post_accumulate_grad_hook(sample) for p in ddp.param_to_name]
    for m in ddp.module.modules():
        handles += [m.register_forward_pre_hook(sample), m.register_forward_hook(sample)]
    system.flush()
    system.step(*batch(args, 0, rank, device))
    system.flush()
    sample()
    for handle in handles:
        handle.remove()
    return peak[0]


def benchmark(args, rank, world, device):
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = make_model(args, device)
    numel = sum(p.numel() for p in model.parameters())
    unit = sum(p.numel() for p in model.layers[0].parameters())
    args.bucket_size = args.bucket_size or max(1, numel // 4)
    systems = [build_torch(args, device), build_fsdp2(args, device),
               build_ml(args, device, strategy="optim_grads", name="ml-zero2")]
    systems += [build_ml(args, device, strategy="optim_grads_params", name=name, **config)
                for name, config in zero3_settings(unit)]
    rows, _ = measure(systems, args, rank, world, device)
    for row, system in zip(rows, systems):
        peak = full_size_peak(system, args, rank, device) if system.wrapper is not None else None
        row["full_size_peak_bytes_per_rank"] = collectives.all_gather_object(peak)
    if rank == 0:
        report(args, numel, unit, rows)


def report(args, numel, unit, rows):
    print(f"GPT {numel:,} parameters ({unit:,} per layer unit), {torch.distributed.get_world_size()} gloo ranks, "
          f"torch {torch.__version__}; median of {args.repeats} alternating rounds ({args.warmup_steps} warm-up)\n")
    print("| system             | step ms | / torch-ddp | comm MB/rank/step | full-size peak MiB | "
          "model state MiB | collectives of one step |")
    print("|--------------------|---------|-------------|-------------------|--------------------|"
          "-----------------|-------------------------|")
    for r in rows:
        peak = r["full_size_peak_bytes_per_rank"]
        peak = "n/a" if peak[0] is None else f"{max(peak) / MIB:.2f}"
        print(f"| {r['system']:<18} | {r['median_step_ms']:>7.1f} | {r['ratio_to_torch_ddp']:>10.3f}x | "
              f"{r['comm_bytes_per_rank_per_step'] / 1e6:>17.2f} | {peak:>18} | "
              f"{max(r['model_state_bytes_per_rank']) / MIB:>15.2f} | {r['collectives']} |")
    agree = all(r["losses_agree"] for r in rows)
    print(f"\nlosses of the first {args.compare_steps} steps agree with torch-ddp within {args.loss_tol:g}: {agree}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in [
        ("num-layers", 6, "transformer layers"), ("hidden-size", 256, "hidden size"),
        ("num-attention-heads", 4, "attention heads"), ("seq-length", 128, "tokens per sample"),
        ("vocab-size", 8192, "vocabulary size"), ("micro-batch-size", 2, "samples per rank and step"),
        ("warmup-steps", 2, "untimed steps per system first"), ("repeats", 30, "timed rounds"),
        ("compare-steps", 10, "compare the losses of the first K steps"),
        ("world-size", 2, "ranks to spawn when not launched by torchrun"),
    ]:
        p.add_argument(f"--{flag}", type=int, default=default, help=f"{text} (default: {default})")
    p.add_argument("--bucket-size", type=int, help="bucket size in elements (default: 1/4 of the parameters)")
    p.add_argument("--tiny", action="store_true", help="a small model, 2 rounds: smoke test")
    args = p.parse_args()
    args.steps, args.lr, args.weight_decay, args.loss_tol = 1, 1e-3, 0.1, 1e-4
    if args.tiny:
        vars(args).update(TINY)
    launch(benchmark, args, world_size(args.world_size), cpu=True, threads_per_rank=1)


if __name__ == "__main__":
    main()
