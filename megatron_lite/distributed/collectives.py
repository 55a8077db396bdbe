"""Every collective megatron-lite issues, and the one place for backend quirks.

Tensor collectives work in place and return a handle with `.wait()`; with `async_op=False` the work is
done on return and the handle is a no-op. On a one-rank group nothing is sent (gloo would still spend
milliseconds copying a large bucket).

Backend choices (measured with benchmarks/collectives_gloo.py, gloo, torch 2.13):
  * gloo's native reduce-scatter costs ~1.3-1.9x an all-reduce of the same bucket, and its all-gather into
    one tensor stages the output in a scratch of its own and copies it out. gloo's broadcast, though, sends
    a tensor straight from where it lies into where it lands. So on gloo `all_gather` is one broadcast per
    rank, of its shard into its place (no scratch, 1.5-2x faster), and a SUM `reduce_scatter` sends shard j
    to rank j and sums the copies of the rank's shard in rank order: at dp=2 as two broadcasts (each rank's
    copy of the other's shard into a one-shard scratch, 1.6-2x faster than an all-to-all), at dp>2 as an
    all-to-all into a bucket-sized scratch. Both move what a ring moves, (N-1)/N of the bucket each way, and
    the sum does not depend on the backend; at dp=2 it is bitwise the all-reduce's sum (a + b is
    commutative). Other ops (AVG, MAX) all-reduce the whole bucket;
  * NCCL (and anything else) uses the native in-place reduce-scatter / all-gather;
  * `reduce_scatter_with_fp32_accumulation` sums the same copies in fp32, on every backend (the gloo path
    above, an all-to-all elsewhere; gloo moves CPU tensors of any dtype, bf16 included).

Observers (`observe`) see every tensor collective as it is issued, with the bytes it moves: benchmarks
count communication through them instead of patching torch.distributed.

The process groups of a data-parallel topology (the distributed-optimizer instances and the holders of each
shard) are built here too, once per process and topology, into a record each wrapper holds: `DataParallelGroups`.
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

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
        return _exchange_sum(bucket, group, None, async_op)
    _notify("reduce_scatter", bucket, world_size)
    own = shard(bucket, world_size, rank)
    return _handle(_reduce_scatter_single(own, bucket, op=op, group=group, async_op=async_op))


def reduce_scatter_with_fp32_accumulation(bucket: torch.Tensor, group=None, async_op: bool = False):
    """In place: rank r's shard r of `bucket` ends with the sum of shard r over the group, added up in fp32
    in rank order and rounded once to the bucket's dtype (megatron-core's reduce_scatter_with_fp32_accumulation).

    What travels is the bucket in its own dtype: shard j to rank j, (N-1)/N of the bucket out and in per
    rank, what a ring reduce-scatter moves (two broadcasts on gloo at dp=2, else an all-to-all). The received
    copies need a scratch (one shard at dp=2 on gloo, else the bucket's size) until `wait()`. Only SUM
    (pre-scale for a mean). The other shards keep the rank's own, unreduced values, on every backend.
    """
    if dist.get_world_size(group) == 1:
        return DONE
    return _exchange_sum(bucket, group, torch.float32, async_op)


class _Works:
    """Handle of several collectives that make up one: `wait()` waits for all of them."""

    def __init__(self, works):
        self._works = works

    def wait(self):
        for work in self._works:
            work.wait()
        self._works = []
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self._works)


class _SumOnWait:
    """Handle of a reduce-scatter done by moving shards: `wait()` waits for the transfers, then sums every
    rank's copy of the rank's shard (`copies`, in rank order, its own among them), rank 0's first, into the
    shard (once; later calls do nothing). `accumulate`: the dtype the sum is done in (rounded once back to
    the bucket's); None: the bucket's dtype, one rounding per add, in place in the first copy (a received
    one, or the rank's own shard: no new memory)."""

    def __init__(self, work, copies: List[torch.Tensor], own: torch.Tensor, accumulate=None):
        self._work, self._copies, self._own, self._accumulate = work, copies, own, accumulate

    def wait(self):
        if self._copies is None:
            return True
        self._work.wait()
        first = self._copies[0]
        total = first if self._accumulate in (None, first.dtype) else first.to(self._accumulate)
        for piece in self._copies[1:]:  # adds in rank order: the result does not depend on the backend
            total.add_(piece)
        if total is not self._own:
            self._own.copy_(total)  # with `accumulate`: the one rounding back to the bucket's dtype
        # Free the scratch now, not when the handle goes: the work, too, holds it (gloo's all-to-all keeps its
        # output tensor), and the bucket keeps this handle until its next iteration.
        self._copies = self._work = None
        return True

    def is_completed(self):
        """Whether the transfers are done (wait() then only sums, without blocking)."""
        return self._copies is None or self._work.is_completed()


def _broadcasts(group, tensors: List[torch.Tensor]) -> _Works:
    """One asynchronous broadcast per group rank r, in rank order, of `tensors[r]`: on rank r what it sends,
    on the others where it lands."""
    world = group or dist.group.WORLD
    return _Works([dist.broadcast(t, src=dist.get_global_rank(world, r), group=group, async_op=True)
                   for r, t in enumerate(tensors)])


def _exchange_sum(bucket: torch.Tensor, group, accumulate, async_op: bool):
    """Shard j of `bucket` to rank j ((N-1)/N of the bucket travels each way); the copies of the rank's shard
    are summed into it on `wait()` (_SumOnWait). gloo at dp=2: two broadcasts, each rank's copy of the other
    rank's shard into a one-shard scratch; otherwise an all-to-all into a bucket-sized scratch (the rank's own
    shard copied there too)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = bucket.view(world_size, -1)  # piece j: shard j as this rank holds it
    own = pieces[rank]
    if world_size == 2 and backend(group) == "gloo":
        _notify("reduce_scatter", bucket, world_size)
        scratch = torch.empty_like(own)
        other = pieces[1 - rank]
        work = _broadcasts(group, [other, scratch] if rank == 0 else [scratch, other])
        copies = [own, scratch] if rank == 0 else [scratch, own]
    else:
        _notify("all_to_all", bucket, world_size)
        received = torch.empty_like(bucket)
        work = _handle(dist.all_to_all_single(received, bucket, group=group, async_op=async_op))
        copies = list(received.view(world_size, -1))
    handle = _SumOnWait(work, copies, own, accumulate)
    if not async_op:
        handle.wait()
    return handle


def all_gather(bucket: torch.Tensor, group=None, async_op: bool = False):
    """In place: every rank's bucket ends with shard r taken from rank r."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return DONE
    _notify("all_gather", bucket, world_size)
    if backend(group) == "gloo":  # each shard broadcast from its rank straight into place (module docstring)
        handle = _broadcasts(group, [shard(bucket, world_size, r) for r in range(world_size)])
        if not async_op:
            handle.wait()
        return handle
    own = shard(bucket, world_size, rank)
    return _handle(_all_gather_single(bucket, own, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                      input_split_sizes: List[int], group=None, async_op: bool = False):
    """Piece q of the flat `input` (input_split_sizes[q] elements, pieces in rank order) goes to rank q; piece p
    of the flat `output` (output_split_sizes[p] elements) receives what rank p sent this rank. Uneven splits
    and empty pieces are fine (gloo and NCCL). NCCL moves device tensors directly; on gloo, tensors off the CPU
    go through host memory (as send/recv here: gloo's tensor support off the CPU is op by op) and the call
    completes before it returns. On a one-rank group the one piece is copied (nothing is sent)."""
    world_size = dist.get_world_size(group)
    if len(output_split_sizes) != world_size or len(input_split_sizes) != world_size:
        raise ValueError(f"all_to_all_single: one split size per rank of the group ({world_size}), got "
                         f"{len(input_split_sizes)} to send and {len(output_split_sizes)} to receive")
    if sum(input_split_sizes) != input.numel() or sum(output_split_sizes) != output.numel():
        raise ValueError(f"all_to_all_single: split sizes {list(input_split_sizes)} / {list(output_split_sizes)} "
                         f"do not add up to the input's {input.numel()} / the output's {output.numel()} elements")
    if world_size == 1:
        output.copy_(input)
        return DONE
    _notify("all_to_all", input, world_size)
    if backend(group) == "gloo" and output.device.type != "cpu":
        staged = torch.empty(output.shape, dtype=output.dtype)
        dist.all_to_all_single(staged, input.cpu(), list(output_split_sizes), list(input_split_sizes), group=group)
        output.copy_(staged)
        return DONE
    return _handle(dist.all_to_all_single(output, input, list(output_split_sizes), list(input_split_sizes),
                                          group=group, async_op=async_op))


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
@dataclass(frozen=True)
class DataParallelGroups:
    """The process groups of a data-parallel topology, as this rank sees them (megatron-core's data-parallel,
    intra and inter distributed-optimizer-instance groups): asked once, by `build`, and held by the
    DistributedDataParallel wrapper, which passes them on to what it builds. The instance groups themselves
    are created once per (WORLD, data-parallel ranks, number of instances) and shared by every wrapper of
    the process (model chunks, a test's many models; megatron-core creates them once in parallel_state):
    torch.distributed keeps every group until destroy_process_group, so a group per wrapper would only pile
    up sockets and threads. `forget_instance_groups` drops them before the WORLD is destroyed."""

    topology: DataParallelTopology
    """Who holds which shard (layout.py): the groups below are its instances and holders."""
    data_parallel_group: Optional[dist.ProcessGroup]
    """The whole data-parallel group (None: WORLD)."""
    intra_instance_group: Optional[dist.ProcessGroup]
    """This rank's distributed-optimizer instance (the buffers shard over it): the data-parallel group
    itself with one instance."""
    inter_instance_group: Optional[dist.ProcessGroup]
    """The holders of this rank's position in every instance (its reduced shard is all-reduced over it);
    None with one instance."""

    @classmethod
    def build(cls, group, topology: DataParallelTopology) -> "DataParallelGroups":
        """The groups of `topology` over the ranks of `group` (its data-parallel group). With several
        instances, two groups, created on the first ask by their member ranks only (the ranks of one instance
        do not wait for another's) and shared by later asks over the same ranks; nothing is created with one
        instance."""
        if topology.num_distributed_optimizer_instances == 1:
            return cls(topology, group, group, None)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # global rank of each group rank
        assert len(ranks) == topology.data_parallel_size, "the topology describes another group"
        key = (dist.group.WORLD, tuple(ranks), topology.num_distributed_optimizer_instances)  # new WORLD: afresh
        if key not in _instance_groups:
            rank = dist.get_rank(group)
            intra = [ranks[r] for r in topology.instance_ranks(topology.instance(rank))]
            inter = [ranks[r] for r in topology.holders(topology.position(rank))]
            _instance_groups[key] = (dist.new_group(intra, use_local_synchronization=True),
                                     dist.new_group(inter, use_local_synchronization=True))
        return cls(topology, group, *_instance_groups[key])


_instance_groups: Dict[tuple, Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
"""(WORLD, the data-parallel group's global ranks, number of instances) -> this rank's (intra-instance,
inter-instance) groups: the one place DataParallelGroups.build keeps what it created."""


def forget_instance_groups():
    """Drop the shared instance groups (live recovery, after a failure, before it destroys the WORLD: a gloo
    group closes its connections, and so releases its peers' blocked operations, only once nothing refers to
    it; the next generation's wrapper creates its own)."""
    _instance_groups.clear()


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
def run_collectively(fn: Callable, *args, group=None, what: Optional[str] = None, group_name: str = ""):
    """`fn(*args)` on every rank of `group` at once; if it raises on any rank, every rank raises: that rank its
    own error, the others a RuntimeError naming the failed ranks and their errors ("{what} failed on rank(s)
    [1]: rank 1: ValueError: ..."), instead of walking into the next collective and waiting there for the
    process-group timeout.

    Costs one small all-reduce (a failure flag per rank); the messages are gathered only after a failure.

    Args:
        what: what failed, as the others' RuntimeError names it (default: fn's name).
        group_name: the group the ranks are numbered in, named before "rank(s)" (e.g. "data-parallel").
    """
    error = None
    try:
        result = fn(*args)
    except BaseException as e:  # re-raised below, on every rank (a Ctrl-C too: the others must hear of it)
        error = e
    # NCCL reduces CUDA tensors only (all_gather_object picks the current device the same way).
    device = torch.device("cuda", torch.cuda.current_device()) if backend(group) == "nccl" else None
    flags = torch.zeros(dist.get_world_size(group), device=device)
    flags[dist.get_rank(group)] = float(error is not None)
    all_reduce(flags, group)
    failed = flags.nonzero().flatten().tolist()
    if not failed:
        return result
    messages = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    ranks = f"{group_name} rank(s)" if group_name else "rank(s)"
    raise RuntimeError(f"{what or getattr(fn, '__name__', fn)} failed on {ranks} {failed}: "
                       + "; ".join(f"rank {r}: {messages[r]}" for r in failed))


def rank_zero_first(fn: Callable, *args, group=None):
    """`fn(*args)` on the group's rank 0 first (e.g. to build a cache), then on the others; returns its
    result on every rank. A failure on rank 0 reaches every rank at once (the others do not start), and so
    does one on any other rank (e.g. a file that only it cannot read)."""
    first = dist.get_rank(group) == 0
    what = getattr(fn, "__name__", fn)  # the others run _nothing: name the work that failed, not theirs
    result = run_collectively(fn if first else _nothing, *args, group=group, what=what)
    later = run_collectively(_nothing if first else fn, *args, group=group, what=what)
    return result if first else later


def _nothing(*args):
    return None
