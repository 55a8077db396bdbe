"""Every collective megatron-lite issues, and the one place for backend quirks.

Tensor collectives work in place and return a handle with `.wait()`; with `async_op=False` the work is
done on return and the handle is a no-op. On a one-rank group nothing is sent (gloo would still spend
milliseconds copying a large bucket).

Backend choices (measured with benchmarks/collectives_gloo.py, 2 gloo ranks, torch 2.13):
  * gloo's native reduce-scatter costs ~1.3-1.9x an all-reduce of the same bucket, so on gloo a SUM
    `reduce_scatter` is an all-to-all (each rank sends shard j to rank j and keeps its own) followed by a
    local sum of the copies of its shard in rank order: the bytes of a ring reduce-scatter ((N-1)/N of the
    bucket each way) in ~0.5-1.0x the all-reduce's time; at dp=2 bitwise the all-reduce's sum (a + b is
    commutative). Other ops (AVG, MAX) all-reduce the whole bucket;
  * NCCL (and anything else) uses the native in-place reduce-scatter / all-gather;
  * `reduce_scatter_with_fp32_accumulation` is the same all-to-all with the sum in fp32, on every backend
    (gloo runs all_to_all_single on CPU tensors of any dtype, bf16 included).

Observers (`observe`) see every tensor collective as it is issued, with the bytes it moves: benchmarks
count communication through them instead of patching torch.distributed.
"""

import contextlib
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from .layout import DataParallelTopology, shard_range

# torch 2.13 renamed the tensor-based collectives; use the new names where they exist.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX


class _Done:
    """Handle of a collective that already completed."""

    def wait(self):
        return True

    def is_completed(self):
        return True


DONE = _Done()


def _handle(work):
    return DONE if work is None else work


# ------------------------------------------------------------------------------------------ observers
_observers: List[Callable[[str, torch.Tensor, int], None]] = []


@contextlib.contextmanager
def observe(callback: Callable[[str, torch.Tensor, int], None]):
    """Within the context, call `callback(name, full_tensor, group_size)` for every tensor collective
    issued, before it is issued. `name` is what actually runs ('all_reduce', 'reduce_scatter', 'all_gather',
    'all_to_all', 'broadcast', 'send'); `full_tensor` is the full-size buffer (a reduce-scatter's input, an
    all-gather's output). Collectives skipped on one-rank groups are not reported."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _notify(name: str, tensor: torch.Tensor, group_size: int):
    for callback in _observers:
        callback(name, tensor, group_size)


# ------------------------------------------------------------------------------------------ helpers
def backend(group: Optional[dist.ProcessGroup]) -> str:
    return str(dist.get_backend(group)).lower()


def reduce_op(average: bool) -> dist.ReduceOp:
    return AVG if average else SUM


def shard(bucket: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size slice of a flat bucket (a view; layout.shard_range's elements)."""
    start, end = shard_range(0, bucket.numel(), world_size, rank)
    return bucket[start:end]


# ------------------------------------------------------------------------------------------ tensors
def all_reduce(tensor: torch.Tensor, group=None, op: dist.ReduceOp = SUM, async_op: bool = False):
    """In place: every rank ends with the reduction (sum, mean or max) of `tensor` over the group."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return DONE
    _notify("all_reduce", tensor, world_size)
    return _handle(dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def reduce_scatter(bucket: torch.Tensor, group=None, op: dist.ReduceOp = SUM, async_op: bool = False):
    """In place: rank r's shard r of `bucket` ends with the reduction of shard r over the group.

    The other shards are left unspecified (reduced, partially reduced or untouched, by backend).
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return DONE
    if backend(group) == "gloo":
        if op != SUM:
            return all_reduce(bucket, group, op, async_op)
        return _all_to_all_sum(bucket, group, None, async_op)
    _notify("reduce_scatter", bucket, world_size)
    own = shard(bucket, world_size, rank)
    return _handle(_reduce_scatter_single(own, bucket, op=op, group=group, async_op=async_op))


def reduce_scatter_with_fp32_accumulation(bucket: torch.Tensor, group=None, async_op: bool = False):
    """In place: rank r's shard r of `bucket` ends with the sum of shard r over the group, added up in fp32
    in rank order and rounded once to the bucket's dtype (megatron-core's reduce_scatter_with_fp32_accumulation).

    What travels is the bucket in its own dtype: an all-to-all sends shard j to rank j, (N-1)/N of the
    bucket out and in per rank, what a ring reduce-scatter moves. The received copies need one bucket-sized
    scratch tensor until `wait()`. Only SUM (pre-scale for a mean). The other shards keep the
    rank's own, unreduced values, on every backend.
    """
    if dist.get_world_size(group) == 1:
        return DONE
    return _all_to_all_sum(bucket, group, torch.float32, async_op)


class _SumOnWait:
    """Handle of a reduce-scatter done as an all-to-all: `wait()` waits for it, then sums the copies of the
    rank's shard, rank 0's first, into the shard (once; later calls do nothing). `accumulate`: the dtype the
    sum is done in (rounded once back to the bucket's); None: the bucket's dtype, one rounding per add."""

    def __init__(self, work, received: torch.Tensor, own: torch.Tensor, world_size: int, accumulate=None):
        self._work, self._received, self._own, self._world_size = work, received, own, world_size
        self._accumulate = accumulate

    def wait(self):
        if self._received is None:
            return True
        self._work.wait()
        pieces = self._received.view(self._world_size, -1)  # piece i: shard r as rank i holds it
        # Summed into the scratch's first piece (no new memory) unless the sum has a dtype of its own.
        total = pieces[0] if self._accumulate in (None, pieces.dtype) else pieces[0].to(self._accumulate)
        for piece in pieces[1:]:  # adds in rank order: the result does not depend on the backend
            total.add_(piece)
        self._own.copy_(total)  # with `accumulate`: the one rounding back to the bucket's dtype
        self._received = None  # free the scratch now, not when the handle goes
        return True

    def is_completed(self):
        return self._received is None


def _all_to_all_sum(bucket: torch.Tensor, group, accumulate, async_op: bool):
    """Shard j of `bucket` to rank j ((N-1)/N of the bucket travels each way; gloo copies the rank's own
    shard locally); the copies of the rank's shard are summed into it on `wait()` (_SumOnWait)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    _notify("all_to_all", bucket, world_size)
    received = torch.empty_like(bucket)
    work = _handle(dist.all_to_all_single(received, bucket, group=group, async_op=async_op))
    handle = _SumOnWait(work, received, shard(bucket, world_size, rank), world_size, accumulate)
    if not async_op:
        handle.wait()
    return handle


def all_gather(bucket: torch.Tensor, group=None, async_op: bool = False):
    """In place: every rank's bucket ends with shard r taken from rank r."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return DONE
    _notify("all_gather", bucket, world_size)
    own = shard(bucket, world_size, rank)
    return _handle(_all_gather_single(bucket, own, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, group=None, src_group_rank: int = 0, async_op: bool = False):
    """In place: every rank ends with the tensor of the group's rank `src_group_rank`."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return DONE
    _notify("broadcast", tensor, world_size)
    src = dist.get_global_rank(group or dist.group.WORLD, src_group_rank)
    return _handle(dist.broadcast(tensor, src=src, group=group, async_op=async_op))


@torch.no_grad()
def broadcast_coalesced(tensors: List[torch.Tensor], group=None, src_group_rank: int = 0):
    """In place: every tensor takes the values of the group's rank `src_group_rank`; one broadcast per dtype."""
    if dist.get_world_size(group) == 1:
        return
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        broadcast(flat, group, src_group_rank)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def send(tensor: torch.Tensor, dst: int, group=None):
    """Point to point: send `tensor` to the group's rank `dst` (blocking). gloo moves host memory only."""
    _notify("send", tensor, 2)
    dist.send(tensor.cpu() if backend(group) == "gloo" else tensor, group_dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group=None):
    """Point to point: receive into `tensor` from the group's rank `src` (blocking)."""
    staged = tensor.cpu() if backend(group) == "gloo" else tensor
    dist.recv(staged, group_src=src, group=group)
    if staged is not tensor:
        tensor.copy_(staged)


# ------------------------------------------------------------------------------------------ groups
_instance_groups = {}


def instance_groups(group, topology: DataParallelTopology):
    """The process groups of `topology`'s distributed-optimizer instances over the ranks of `group` (its
    data-parallel group): this rank's instance (intra-instance group) and the holders of this rank's
    position in every instance (inter-instance group); see layout.DataParallelTopology.

    Returns (intra-instance group, inter-instance group) of this rank; (group, None) for one instance.
    Created once per (group, number of instances) by the member ranks only."""
    if topology.num_distributed_optimizer_instances == 1:
        return group, None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # global rank of each group rank
    assert len(ranks) == topology.data_parallel_size, "the topology describes another group"
    key = (dist.group.WORLD, tuple(ranks), topology.num_distributed_optimizer_instances)  # new WORLD: afresh
    if key not in _instance_groups:
        rank = dist.get_rank(group)
        intra = [ranks[r] for r in topology.instance_ranks(topology.instance(rank))]
        inter = [ranks[r] for r in topology.holders(topology.position(rank))]
        _instance_groups[key] = (dist.new_group(intra, use_local_synchronization=True),
                                 dist.new_group(inter, use_local_synchronization=True))
    return _instance_groups[key]


# ------------------------------------------------------------------------------------------ objects
def barrier(group=None):
    dist.barrier(group=group)


def all_gather_object(obj: Any, group=None) -> list:
    """Every rank's `obj` (picklable), indexed by rank in the group."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, group=None, dst_group_rank: int = 0) -> Optional[list]:
    """Every rank's `obj` (picklable), indexed by rank in the group, on the group's rank `dst_group_rank`;
    None on the others."""
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst_group_rank else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group or dist.group.WORLD, dst_group_rank), group=group)
    return out


def broadcast_object(obj: Any, group=None, src_group_rank: int = 0) -> Any:
    """The `obj` of the group's rank `src_group_rank`, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, src_group_rank), group=group)
    return box[0]


# ------------------------------------------------------------------------------------------ errors
def run_collectively(fn: Callable, *args, group=None):
    """`fn(*args)` on every rank; if it raises on any rank, every rank raises (naming the ranks) instead of
    the others walking into the next collective and waiting there for the process-group timeout."""
    error = None
    try:
        result = fn(*args)
    except BaseException as e:  # re-raised below, on every rank (a Ctrl-C too: the others must hear of it)
        error = e
    failures = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    failed = {rank: text for rank, text in enumerate(failures) if text is not None}
    if failed:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on rank(s) {sorted(failed)}: "
                           + "; ".join(f"rank {r}: {t}" for r, t in failed.items()))
    return result


def rank_zero_first(fn: Callable, *args, group=None):
    """`fn(*args)` on the group's rank 0 first (e.g. to build a cache), then on the others; returns its
    result on every rank. A failure on rank 0 reaches every rank at once (the others do not start), and so
    does one on any other rank (e.g. a file that only it cannot read)."""
    first = dist.get_rank(group) == 0
    result = run_collectively(fn if first else _nothing, *args, group=group)
    later = run_collectively(_nothing if first else fn, *args, group=group)
    return result if first else later


def _nothing(*args):
    return None
