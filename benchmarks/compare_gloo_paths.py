"""gloo's broadcast paths against the calls they replaced, side by side in one run (issue 21).

Since 2026-11-26 `collectives.all_gather` on gloo is one broadcast per rank straight into place, and at dp=2
a SUM `collectives.reduce_scatter` is two broadcasts (docs/ddp_buffer_and_buckets.md). Before, they were
torch's `all_gather_single` (`all_gather_into_tensor`) and an all-to-all. This benchmark trains ZeRO-3 and
ZeRO-2 twice each on compare_ddp's GPT, once with the current paths and once with the old ones swapped in
for that system's steps, plus torch DDP, alternating (timing.py), and checks that the old and new paths give
identical losses::

    python -m benchmarks.compare_gloo_paths [--repeats 30]
"""

import argparse
import contextlib

import torch
import torch.distributed as dist

from benchmarks.compare_ddp_systems import batch, build_ml, build_torch, make_model
from benchmarks.launch import launch
from benchmarks.timing import alternate
from megatron_lite.distributed import collectives

GPT = dict(num_layers=6, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=8192, micro_batch_size=2,
           lr=1e-3, weight_decay=0.1)


def native_all_gather(bucket, group=None, async_op=False):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    collectives._notify("all_gather", bucket, world)
    own = collectives.shard(bucket, world, rank)
    return collectives._handle(collectives._all_gather_single(bucket, own, group=group, async_op=async_op))


def all_to_all_reduce_scatter(bucket, group=None, op=collectives.SUM, async_op=False):
    assert op == collectives.SUM
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    collectives._notify("all_to_all", bucket, world)
    received = torch.empty_like(bucket)
    work = collectives._handle(dist.all_to_all_single(received, bucket, group=group, async_op=async_op))
    handle = collectives._SumOnWait(work, list(received.view(world, -1)), bucket.view(world, -1)[rank])
    if not async_op:
        handle.wait()
    return handle


@contextlib.contextmanager
def old_paths():
    """collectives' all-gather and reduce-scatter as they were before 2026-11-26, inside the context."""
    current = collectives.all_gather, collectives.reduce_scatter
    collectives.all_gather, collectives.reduce_scatter = native_all_gather, all_to_all_reduce_scatter
    try:
        yield
    finally:
        collectives.all_gather, collectives.reduce_scatter = current


def benchmark(args, rank, world, device):
    args.bucket_size = max(1, sum(p.numel() for p in make_model(args, device).parameters()) // 4)
    systems = [build_ml(args, device, strategy="optim_grads_params", name="ZeRO-3 broadcasts"),
               build_ml(args, device, strategy="optim_grads_params", name="ZeRO-3 old paths"),
               build_ml(args, device, strategy="optim_grads", name="ZeRO-2 broadcasts"),
               build_ml(args, device, strategy="optim_grads", name="ZeRO-2 old paths"),
               build_torch(args, device)]
    old = {1, 3}
    losses = [[] for _ in systems]

    def step(k, x, y):
        with old_paths() if k in old else contextlib.nullcontext():
            losses[k].append(systems[k].step(x, y).item())
            systems[k].flush()

    def prepare(k):
        return batch(args, len(losses[k]), rank, device)

    timings = alternate(step, len(systems), args.repeats, 1, 2, device, prepare=prepare)
    if rank == 0:
        torch_ms = timings.median_ms(len(systems) - 1)
        print(f"gloo, {world} ranks, median of {args.repeats} alternating steps (step ms, / torch DDP):")
        for k, system in enumerate(systems):
            print(f"  {system.name:18s} {timings.median_ms(k):7.1f} ms  {timings.median_ms(k) / torch_ms:.3f}x")
        print(f"losses identical, old vs new paths: ZeRO-3 {losses[0] == losses[1]}, ZeRO-2 {losses[2] == losses[3]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (default: 30)")
    args = parser.parse_args()
    vars(args).update(GPT)
    launch(benchmark, args, 2, cpu=True, threads_per_rank=1)


if __name__ == "__main__":
    main()
