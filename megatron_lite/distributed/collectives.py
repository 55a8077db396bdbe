"""Every collective megatron-lite issues, and the one place for backend quirks.

All functions take a flat bucket tensor (CPU tensors with gloo, CUDA tensors with NCCL) and return a
handle with `.wait()`; with `async_op=False` the work is done on return and the handle is a no-op.

Backend choices (measured with benchmarks/collectives_gloo.py, 2 gloo ranks, torch 2.13):
  * gloo's reduce-scatter costs ~2.3x an all-reduce of the same bucket (16M fp32: 145 ms vs 63 ms), so on
    gloo `reduce_scatter` all-reduces the whole bucket, which leaves the rank's shard with exactly the
    values a reduce-scatter would produce (the other shards are reduced too, which is harmless);
  * NCCL (and anything else) uses the native in-place reduce-scatter / all-gather.
"""

from typing import Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-based collectives; use the new names where they exist.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """Handle of a collective that already completed."""

    def wait(self):
        return True

    def is_completed(self):
        return True


DONE = _Done()


def _handle(work):
    return DONE if work is None else work


def backend(group: Optional[dist.ProcessGroup]) -> str:
    return str(dist.get_backend(group)).lower()


def reduce_op(average: bool) -> dist.ReduceOp:
    return dist.ReduceOp.AVG if average else dist.ReduceOp.SUM


def shard(bucket: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size slice of a flat bucket (a view)."""
    assert bucket.numel() % world_size == 0, "buckets are padded to a multiple of the dp size"
    size = bucket.numel() // world_size
    return bucket[rank * size:(rank + 1) * size]


def all_reduce(bucket: torch.Tensor, group=None, average: bool = False, async_op: bool = False):
    """In place: every rank ends with the sum (or mean) of `bucket` over the group."""
    if dist.get_world_size(group) == 1:
        return DONE  # nothing to exchange (gloo would still spend milliseconds on a large bucket)
    return _handle(dist.all_reduce(bucket, op=reduce_op(average), group=group, async_op=async_op))


def reduce_scatter(bucket: torch.Tensor, group=None, average: bool = False, async_op: bool = False):
    """In place: rank r's shard r of `bucket` ends with the sum (or mean) of shard r over the group.

    The other shards are left unspecified (reduced, partially reduced or untouched, by backend).
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1 or backend(group) == "gloo":
        return all_reduce(bucket, group, average, async_op)
    own = shard(bucket, world_size, rank)
    return _handle(_reduce_scatter_single(own, bucket, op=reduce_op(average), group=group, async_op=async_op))


def all_gather(bucket: torch.Tensor, group=None, async_op: bool = False):
    """In place: every rank's bucket ends with shard r taken from rank r."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return DONE
    own = shard(bucket, world_size, rank)
    return _handle(_all_gather_single(bucket, own, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, group=None, src_group_rank: int = 0, async_op: bool = False):
    """In place: every rank ends with the tensor of the group's rank `src_group_rank`."""
    src = dist.get_global_rank(group or dist.group.WORLD, src_group_rank)
    return _handle(dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def all_reduce_flags(flags: torch.Tensor, group=None) -> torch.Tensor:
    """Synchronous element-wise sum of a small tensor (used to agree on error conditions)."""
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return flags
