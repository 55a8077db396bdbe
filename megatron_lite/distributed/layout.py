"""Where every parameter and bucket lives in a ParamAndGradBuffer: pure functions of sizes and flags.

Parameters are laid out in *reverse* registration order, which is roughly the order in which backward
produces their gradients, so the first bucket is the first one ready to communicate::

    registration order:  p0 p1 p2 p3            buffer:  | p3 p2 | p1 p0 ....pad |
                                                          bucket 0  bucket 1

Rules (megatron.core's, so the same model and config give the same offsets):
  * a bucket closes right after the first parameter whose end reaches `bucket_size` elements from the
    bucket start, so a parameter is never split between buckets; `bucket_size=None` means one bucket;
  * without the distributed optimizer there is no padding at all;
  * with it, each parameter starts at a multiple of 64 elements and each bucket end is padded to a
    multiple of lcm(dp, 128) (lcm(dp, 128, 2^16) with `pad_buckets_for_high_nccl_busbw`), so every bucket
    splits into `dp` equal shards;
  * with it, a parameter marked `shared_embedding` gets a bucket of its own;
  * with `unit_ids` (ZeRO-3's units of gathering), a bucket never spans two units.

Who owns which elements is decided here as well, for any rank and without process groups. With
`num_distributed_optimizer_instances` R, the dp ranks form R instances of m = dp / R consecutive ranks
(megatron-core's intra distributed-optimizer-instance groups); every bucket splits into m equal shards, and
the rank at *position* j of each instance owns shard j, so the ranks at one position (j, j+m, ...: an inter
distributed-optimizer-instance group) hold the same shard::

    dp=4, R=2         instance 0       instance 1
    data-parallel rank  0      1         2      3
    position            0      1         0      1        holders(0) = (0, 2), holders(1) = (1, 3)
    bucket [0, 256)   [0,128) [128,256) [0,128) [128,256)

Parameter by parameter, a shard owns each parameter's overlap with it (`BufferLayout.owned_ranges`: what a
distributed optimizer updates; a parameter may straddle two shards, padding belongs to none).

That is the unit of an elementwise optimizer (Adam, SGD). A matrix optimizer (Muon) orthogonalizes each matrix's
momentum with Newton-Schulz, which needs the whole matrix: its unit is a whole matrix. `compute_matrix_ownership`
gives each matrix to one position, balancing the Newton-Schulz cost (`newton_schulz_cost`), and again the ranks
at one position hold the same; a fused parameter (QKV) is orthogonalized as row-range sub-matrices::

    one GPT layer (h=64, ffn=256, 4 heads, 2 groups), cost in units of 1024 multiply-adds per iteration:
    fc1 (256x64) 2304   fc2 (64x256) 2304   qkv (128x64) 1088 = Q 768 + K 160 + V 160   proj (64x64) 768

    dp=4, R=2: positions 0, 1     position 0 (ranks 0, 2): fc1, qkv    load 3392
                                  position 1 (ranks 1, 3): fc2, proj   load 3072

The buffer layout is the same for both kinds: a matrix's momentum lives in the flat shards like Adam's moments.
For the orthogonalization, `compute_matrix_exchange` says what each position sends to which owner (its flat pieces
of the owner's matrices) and gets back (the orthogonalized values of the same pieces), in one fixed order, so that
one all-to-all over an instance brings every matrix together at its owner and a second one brings the pieces home::

    dp=2, one bucket [A (owner 0) | B (owner 1)], B straddles the shard boundary:
    buffer     | A ........ | B ....... : ....... | pad |
    shards     |<------ position 0 --->:<--- position 1 ---->|
    position 0 sends: to 0 A[all]           to 1 B[0:k]          (send splits |A|, k)
    position 1 sends: to 0 nothing          to 1 B[k:]           (send splits 0, |B|-k)
    owner 1 receives: from 0 B[0:k], from 1 B[k:] -> B whole; the orthogonalized pieces go back the same way

Nothing here touches tensors, so the rules are unit-tested exhaustively without processes.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

PARAM_START_ALIGNMENT = 64
"""Distributed optimizer: every parameter starts at a multiple of this many elements."""


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: elements [start, end) of the buffer; `end - start` is divisible by dp when padded."""

    start: int
    end: int
    numel_unpadded: int
    """Elements from `start` to the end of the bucket's last parameter, i.e. without the end padding
    (megatron.core's definition; a bucket closed early for a shared embedding also counts the 64-element
    alignment gap before that embedding's start)."""
    param_indices: Tuple[int, ...]
    """Indices into the caller's parameter list, in buffer order (reverse registration order)."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, num_shards: int, position: int) -> Tuple[int, int]:
        """Elements [lo, hi) of the buffer that shard `position` of this bucket's `num_shards` owns."""
        return shard_range(self.start, self.end, num_shards, position)


@dataclass(frozen=True)
class OwnedRange:
    """The part of one parameter that one shard of its bucket owns (what a distributed optimizer updates),
    in the three coordinates its readers use."""

    param_index: int
    """Index into the caller's parameter list."""
    bucket_id: int
    buffer_start: int
    """[buffer_start, buffer_end): the elements, in buffer coordinates."""
    buffer_end: int
    param_start: int
    """[param_start, param_end): the same elements in the flattened parameter."""
    param_end: int
    shard_start: int
    """Where they start in the shard (the bucket's elements this shard owns)."""


@dataclass(frozen=True)
class BufferLayout:
    param_ranges: Tuple[Tuple[int, int, int], ...]
    """(start, end, bucket_id) for each parameter, indexed like the caller's parameter list."""
    buckets: Tuple[BucketLayout, ...]
    numel: int
    """Buffer size including all padding."""
    numel_unpadded: int
    """Sum of the buckets' `numel_unpadded`."""

    def owned_ranges(self, num_shards: int, position: int) -> Tuple[OwnedRange, ...]:
        """What shard `position` of every bucket's `num_shards` owns, parameter by parameter: each parameter's
        overlap with the shard (a parameter may straddle a shard boundary; padding belongs to no parameter), in
        buffer order (bucket by bucket, each in its `param_indices` order)."""
        owned = []
        for bucket_id, bucket in enumerate(self.buckets):
            lo_shard, hi_shard = bucket.shard(num_shards, position)
            for index in bucket.param_indices:
                start, end, _ = self.param_ranges[index]
                lo, hi = max(start, lo_shard), min(end, hi_shard)
                if lo < hi:
                    owned.append(OwnedRange(index, bucket_id, lo, hi, lo - start, hi - start, lo - lo_shard))
        return tuple(owned)


def default_bucket_size(data_parallel_world_size: int) -> int:
    """Megatron's bucket size with overlap_grad_reduce: max(40M, 1M x dp) elements."""
    return max(40_000_000, 1_000_000 * data_parallel_world_size)


def bucket_end_divisor(data_parallel_world_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """Bucket ends are padded to a multiple of this (distributed optimizer only)."""
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(data_parallel_world_size, 128, 2**16)
    return math.lcm(data_parallel_world_size, 128)


def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def compute_buffer_layout(
    param_numels: Sequence[int],
    *,
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embedding: Optional[Sequence[bool]] = None,
    unit_ids: Optional[Sequence[int]] = None,
) -> BufferLayout:
    """Lay out parameters (given in registration order) in one buffer and cut it into buckets.

    Args:
        param_numels: element count of each parameter, in registration order.
        bucket_size: elements per bucket (see module docstring); None for a single bucket.
        data_parallel_world_size: dp, the number of shards each bucket is split into.
        use_distributed_optimizer: enables the padding rules and shared-embedding buckets.
        pad_buckets_for_high_nccl_busbw: pad bucket ends to lcm(dp, 128, 2^16).
        shared_embedding: per parameter, whether it is marked `shared_embedding`.
        unit_ids: per parameter, the unit of gathering it belongs to (ZeRO-3): a bucket never holds
            parameters of two units (it closes before the first parameter of another unit).
    Returns:
        A BufferLayout; `param_ranges[i]` belongs to `param_numels[i]`.
    """
    if data_parallel_world_size < 1:
        raise ValueError(f"data_parallel_world_size must be >= 1, got {data_parallel_world_size}")
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive or None, got {bucket_size}")
    if shared_embedding is None:
        shared_embedding = [False] * len(param_numels)
    if len(shared_embedding) != len(param_numels):
        raise ValueError("shared_embedding must have one entry per parameter")
    padded = use_distributed_optimizer
    divisor = bucket_end_divisor(data_parallel_world_size, pad_buckets_for_high_nccl_busbw)

    param_ranges = [None] * len(param_numels)
    buckets = []
    bucket_start = 0
    bucket_params = []  # indices of the parameters in the open bucket

    def close_bucket(last_param_end: int) -> int:
        nonlocal bucket_start, bucket_params
        end = _round_up(last_param_end, divisor) if padded else last_param_end
        buckets.append(BucketLayout(bucket_start, end, last_param_end - bucket_start, tuple(bucket_params)))
        bucket_start, bucket_params = end, []
        return end

    next_start = 0
    if unit_ids is not None and len(unit_ids) != len(param_numels):
        raise ValueError("unit_ids must have one entry per parameter")
    for index in reversed(range(len(param_numels))):
        if unit_ids is not None and bucket_params and unit_ids[index] != unit_ids[bucket_params[-1]]:
            next_start = close_bucket(next_start)  # another unit: a bucket of its own
        start = _round_up(next_start, PARAM_START_ALIGNMENT) if padded else next_start
        needs_own_bucket = padded and bool(shared_embedding[index])
        if needs_own_bucket and bucket_params:
            start = close_bucket(start)  # close the open bucket; this param starts the next one
        end = start + int(param_numels[index])
        param_ranges[index] = (start, end, len(buckets))
        bucket_params.append(index)
        if needs_own_bucket or (bucket_size is not None and end - bucket_start >= bucket_size):
            next_start = close_bucket(end)
        else:
            next_start = end
    if bucket_params:
        close_bucket(next_start)

    numel = buckets[-1].end if buckets else 0
    numel_unpadded = sum(b.numel_unpadded for b in buckets)
    assert numel_unpadded <= numel
    assert numel == numel_unpadded or padded
    assert not padded or numel % data_parallel_world_size == 0
    return BufferLayout(tuple(param_ranges), tuple(buckets), numel, numel_unpadded)


# ------------------------------------------------------------------------------------------ ownership
def shard_range(start: int, end: int, num_shards: int, position: int) -> Tuple[int, int]:
    """Elements [lo, hi) of the bucket [start, end) owned by shard `position` of `num_shards`: the
    position-th of num_shards equal contiguous pieces (megatron-core's shard_buffer). The bucket's size must
    split evenly, which the distributed optimizer's padding (bucket_end_divisor) guarantees."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= position < num_shards:
        raise ValueError(f"position must be in [0, {num_shards}), got {position}")
    if end < start or (end - start) % num_shards:
        raise ValueError(f"the bucket [{start}, {end}) does not split into {num_shards} equal shards: its size "
                         f"must be a multiple of num_shards (pad it, see bucket_end_divisor)")
    size = (end - start) // num_shards
    return start + position * size, start + (position + 1) * size


@dataclass(frozen=True)
class DataParallelTopology:
    """Which data-parallel rank holds which shard: the data-parallel size and the number of
    distributed-optimizer instances, validated once (see the module docstring for the picture).

    Ranks are data-parallel ranks, i.e. ranks in the data-parallel group, not global ones. With one
    instance a rank's position is the rank itself and it is the only holder of its shard.
    """

    data_parallel_size: int
    """dp, the number of ranks in the data-parallel group."""
    num_distributed_optimizer_instances: int = 1
    """R, the number of copies of the distributed optimizer's sharded state; must divide dp."""

    def __post_init__(self):
        for name in ("data_parallel_size", "num_distributed_optimizer_instances"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.data_parallel_size % self.num_distributed_optimizer_instances:
            raise ValueError(f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances} does "
                             f"not divide the data-parallel size {self.data_parallel_size} (data_parallel_size): "
                             f"each instance needs the same number of ranks")

    @classmethod
    def from_instance_size(cls, data_parallel_size: int, instance_size: int) -> "DataParallelTopology":
        """The topology of `data_parallel_size` ranks in instances of `instance_size` ranks (as a last-words
        file records it, or an elastic job's generation of whole instances); ValueError unless the instance
        size divides the data-parallel size."""
        if not isinstance(instance_size, int) or instance_size < 1 or data_parallel_size % instance_size:
            raise ValueError(f"an instance size of {instance_size!r} ranks does not divide the data-parallel size "
                             f"{data_parallel_size}")
        return cls(data_parallel_size, data_parallel_size // instance_size)

    @property
    def intra_distributed_optimizer_instance_size(self) -> int:
        """m = dp / R: ranks per instance, i.e. the number of shards every bucket splits into."""
        return self.data_parallel_size // self.num_distributed_optimizer_instances

    def _check(self, name: str, value: int, bound: int):
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in [0, {bound}), got {value}")

    def position(self, rank: int) -> int:
        """The shard index of data-parallel rank `rank` inside its instance (megatron-core's
        intra_distributed_optimizer_instance_rank)."""
        self._check("rank", rank, self.data_parallel_size)
        return rank % self.intra_distributed_optimizer_instance_size

    def instance(self, rank: int) -> int:
        """The distributed-optimizer instance of data-parallel rank `rank`."""
        self._check("rank", rank, self.data_parallel_size)
        return rank // self.intra_distributed_optimizer_instance_size

    def holders(self, position: int) -> Tuple[int, ...]:
        """The data-parallel ranks at `position` of every instance, in instance order: the holders of one
        shard (megatron-core's inter distributed-optimizer-instance group)."""
        m = self.intra_distributed_optimizer_instance_size
        self._check("position", position, m)
        return tuple(range(position, self.data_parallel_size, m))

    def instance_ranks(self, instance: int) -> Tuple[int, ...]:
        """The data-parallel ranks of `instance`, in position order (megatron-core's intra
        distributed-optimizer-instance group)."""
        self._check("instance", instance, self.num_distributed_optimizer_instances)
        m = self.intra_distributed_optimizer_instance_size
        return tuple(range(instance * m, (instance + 1) * m))

    def owned_range(self, start: int, end: int, rank: int) -> Tuple[int, int]:
        """Elements [lo, hi) of the bucket [start, end) that data-parallel rank `rank` owns (and that every
        other holder of its position owns as well)."""
        return shard_range(start, end, self.intra_distributed_optimizer_instance_size, self.position(rank))


# ------------------------------------------------------------------------------- whole-matrix ownership
def newton_schulz_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a rows x cols matrix, as torch.optim.Muon runs it: on the
    wide orientation s x l (s = min, l = max), X X^T is s*s*l, A A is s^3 and B X is s*s*l, so s^2 (2l + s).
    Every matrix runs the same number of iterations, so this is what balancing needs (normalizing by the
    Frobenius norm, O(s*l), is left out)."""
    small, large = min(rows, cols), max(rows, cols)
    return small * small * (2 * large + small)


@dataclass(frozen=True)
class MatrixOwnership:
    """Which position orthogonalizes which matrix (see the module docstring): indexed like the caller's
    parameter list; the data-parallel ranks at that position of every instance (`holders`) hold the same."""

    topology: DataParallelTopology
    owner: Tuple[Optional[int], ...]
    """Per parameter: the position that owns it whole; None for a parameter that is not a matrix (an elementwise
    optimizer's, owned by flat ranges)."""
    sub_matrices: Tuple[Tuple[Tuple[int, int], ...], ...]
    """Per parameter: the row ranges [lo, hi) orthogonalized one at a time, in row order: ((0, rows),) for a
    matrix not split, () for a parameter that is not a matrix."""
    costs: Tuple[int, ...]
    """Per parameter: `newton_schulz_cost` summed over its sub-matrices; 0 for a parameter that is not a matrix."""

    def owned(self, position: int) -> Tuple[int, ...]:
        """Indices of the matrices that `position` owns, ascending."""
        self.topology.holders(position)  # validates position
        return tuple(index for index, owner in enumerate(self.owner) if owner == position)

    def owned_by_rank(self, rank: int) -> Tuple[int, ...]:
        """Indices of the matrices that data-parallel rank `rank` orthogonalizes, ascending."""
        return self.owned(self.topology.position(rank))

    def load(self, position: int) -> int:
        """Newton-Schulz multiply-adds per iteration at `position`: the sum of its matrices' costs."""
        return sum(self.costs[index] for index in self.owned(position))

    def holders(self, index: int) -> Tuple[int, ...]:
        """The data-parallel ranks that orthogonalize parameter `index` (one per instance); ValueError for a
        parameter that is not a matrix."""
        if self.owner[index] is None:
            raise ValueError(f"parameter {index} is not a matrix: no position owns it whole")
        return self.topology.holders(self.owner[index])


def _sub_matrices(index: int, shape: Tuple[int, ...], split: Optional[Sequence[int]]) -> Tuple[Tuple[int, int], ...]:
    rows = shape[0]
    if split is None:
        return ((0, rows),)
    sizes = [int(size) for size in split]
    if not sizes or any(size <= 0 for size in sizes) or sum(sizes) != rows:
        raise ValueError(f"row_splits[{index}] = {list(split)} must be positive row counts summing to the "
                         f"parameter's {rows} rows (e.g. [q, k, v] rows of a fused QKV)")
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return tuple((start, start + size) for start, size in zip(starts, sizes))


def compute_matrix_ownership(
    shapes: Sequence[Sequence[int]],
    is_matrix: Sequence[bool],
    topology: DataParallelTopology,
    *,
    row_splits: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> MatrixOwnership:
    """Give every matrix, whole, to one position of an instance, balancing Newton-Schulz cost.

    Longest processing time first (LPT): matrices by cost, highest first (ties: lower index first), each to the
    position with the least load so far (ties: lower position). The highest load is at most (4/3 - 1/(3m)) of
    the best possible (Graham 1969), m = dp / R positions. Only the inputs decide it, so every rank computes the
    same ownership.

    Args:
        shapes: each parameter's full shape (a sharded or meta-device build must pass the shape it has as a
            layer, not its local placeholder's), in the caller's order.
        is_matrix: per parameter, whether a matrix optimizer owns it; each must then have two dimensions.
            Deciding it (embeddings, output layer, norms and biases go elsewhere) is the caller's.
        topology: the data-parallel size and instances.
        row_splits: per parameter, None or the row counts of its sub-matrices (a fused QKV: [q, k, v] rows),
            orthogonalized one at a time; the parameter is still owned whole by one position.
    Returns:
        A MatrixOwnership indexed like `shapes`.
    """
    if not isinstance(topology, DataParallelTopology):
        raise TypeError(f"topology must be a DataParallelTopology, got {type(topology).__name__}")
    shapes = [tuple(int(size) for size in shape) for shape in shapes]
    if len(is_matrix) != len(shapes):
        raise ValueError(f"is_matrix has {len(is_matrix)} entries for {len(shapes)} parameters: one per parameter")
    if row_splits is None:
        row_splits = [None] * len(shapes)
    if len(row_splits) != len(shapes):
        raise ValueError(f"row_splits has {len(row_splits)} entries for {len(shapes)} parameters: one per parameter")

    sub_matrices, costs = [], []
    for index, (shape, matrix, split) in enumerate(zip(shapes, is_matrix, row_splits)):
        if any(size < 0 for size in shape):
            raise ValueError(f"parameter {index} has shape {shape}: sizes must be >= 0")
        if not matrix:
            if split is not None:
                raise ValueError(f"row_splits[{index}] is given but parameter {index} is not a matrix (is_matrix)")
            sub_matrices.append(())
            costs.append(0)
            continue
        if len(shape) != 2:
            raise ValueError(f"parameter {index} is a matrix (is_matrix) but has shape {shape}: a matrix optimizer "
                             f"needs its two dimensions (a sharded or meta-device build must pass the full shape)")
        pieces = _sub_matrices(index, shape, split)
        sub_matrices.append(pieces)
        costs.append(sum(newton_schulz_cost(hi - lo, shape[1]) for lo, hi in pieces))

    num_positions = topology.intra_distributed_optimizer_instance_size
    loads = [0] * num_positions
    owner = [None] * len(shapes)
    matrices = [index for index, matrix in enumerate(is_matrix) if matrix]
    for index in sorted(matrices, key=lambda i: (-costs[i], i)):
        position = min(range(num_positions), key=lambda p: (loads[p], p))
        owner[index] = position
        loads[position] += costs[index]
    return MatrixOwnership(topology, tuple(owner), tuple(sub_matrices), tuple(costs))


# ----------------------------------------------------------------------------------- whole-matrix exchange
@dataclass(frozen=True)
class ExchangePiece:
    """Elements [param_start, param_end) of the flattened parameter `param_index`: one position's flat piece of
    a matrix (its overlap with the position's shard), as it travels to the matrix's owner and back."""

    param_index: int
    """Index into the caller's parameter list (the layouts' parameters, concatenated)."""
    param_start: int
    param_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class MatrixExchange:
    """What one position of an instance sends and receives to bring matrices whole to their owners (see the
    module docstring). The way back mirrors it: the owner returns each received piece, orthogonalized, to where
    it came from, in the same order, so the second all-to-all's splits are the first one's, swapped."""

    position: int
    sends: Tuple[Tuple[ExchangePiece, ...], ...]
    """Per destination position q: this position's pieces of q's matrices, by matrix index (ascending); the
    send buffer is their concatenation, destination by destination."""
    receives: Tuple[Tuple[ExchangePiece, ...], ...]
    """Per source position p: p's pieces of this position's matrices, in p's send order; the receive buffer
    is their concatenation, source by source."""
    owned: Tuple[int, ...]
    """The matrices this position assembles whole and orthogonalizes (MatrixOwnership.owned), ascending."""

    @property
    def send_splits(self) -> Tuple[int, ...]:
        """Elements sent to each position (all_to_all_single's input split sizes)."""
        return tuple(sum(piece.numel for piece in pieces) for pieces in self.sends)

    @property
    def recv_splits(self) -> Tuple[int, ...]:
        """Elements received from each position (all_to_all_single's output split sizes)."""
        return tuple(sum(piece.numel for piece in pieces) for pieces in self.receives)


def _matrix_pieces(layouts: Sequence[BufferLayout], ownership: MatrixOwnership, num_shards: int, position: int):
    """Per matrix owned by anyone: `position`'s piece of it (global index -> ExchangePiece), in the layouts'
    concatenated indexing."""
    pieces, offset = {}, 0
    for layout in layouts:
        for owned in layout.owned_ranges(num_shards, position):
            index = offset + owned.param_index
            if ownership.owner[index] is not None:  # a parameter lies in one bucket: one piece per shard at most
                pieces[index] = ExchangePiece(index, owned.param_start, owned.param_end)
        offset += len(layout.param_ranges)
    return pieces


def compute_matrix_exchange(layouts: Sequence[BufferLayout], ownership: MatrixOwnership,
                            position: int) -> MatrixExchange:
    """What `position` sends to and receives from every position of its instance so that each matrix is whole
    at its owner (compute_matrix_ownership), and the orthogonalized pieces come back where the buffer layout
    keeps them (BufferLayout.owned_ranges with the instance's m shards).

    Order (the same on every rank, so the splits agree): destination (source) positions ascending; within one,
    the owner's matrices by index; a position sends a matrix only if its shard overlaps it.

    Args:
        layouts: the buffers sharded over the instance, in order; `ownership` indexes their parameters
            concatenated (layout 0's parameters, then layout 1's, ...).
        ownership: whole-matrix ownership over those parameters; its topology gives m = dp / R.
        position: this rank's position in its instance.
    Returns:
        A MatrixExchange.
    """
    total = sum(len(layout.param_ranges) for layout in layouts)
    if total != len(ownership.owner):
        raise ValueError(f"the layouts hold {total} parameters, the matrix ownership {len(ownership.owner)}: both "
                         f"must index the same parameters")
    m = ownership.topology.intra_distributed_optimizer_instance_size
    ownership.topology.holders(position)  # validates position
    owned = [ownership.owned(q) for q in range(m)]
    mine = _matrix_pieces(layouts, ownership, m, position)
    sends = tuple(tuple(mine[i] for i in owned[q] if i in mine) for q in range(m))
    receives = []
    for p in range(m):
        theirs = mine if p == position else _matrix_pieces(layouts, ownership, m, p)
        receives.append(tuple(theirs[i] for i in owned[position] if i in theirs))
    return MatrixExchange(position, sends, tuple(receives), owned[position])
