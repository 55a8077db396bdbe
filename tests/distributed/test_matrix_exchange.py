"""Golden tables and properties of the whole-matrix exchange plan (layout.compute_matrix_exchange): what each
position of an instance sends to the owner of each matrix and gets back, so that Muon's Newton-Schulz runs on
whole matrices while the momentum stays in the flat shards. Computed by hand from the buffer layout's rules.

The model of the golden rows: registration order p0 = 12 x 8 (96 elements, a matrix), p1 = 10 x 8 (80, a matrix),
p2 = 100 elements (a bias, not a matrix). Reverse order in the buffer, 64-element alignment, the bucket padded::

    buffer   | p2 [0, 100) | pad | p1 [128, 208) | pad | p0 [256, 352) | pad to 384 |
    m=2      |<------ position 0 [0, 192) ------>:<----- position 1 [192, 384) ---->|   p1 straddles
    m=4      |<- 0 [0, 96) ->|<- 1 [96, 192) ->|<- 2 [192, 288) ->|<- 3 [288, 384) ->|  p1 and p0 straddle

Newton-Schulz costs: p0 8^2 (2*12 + 8) = 2048, p1 8^2 (2*10 + 8) = 1792: LPT gives p0 to position 0, p1 to 1.
"""

import random

import pytest
import torch

from megatron_lite.distributed.layout import (
    DataParallelTopology,
    ExchangePiece,
    compute_buffer_layout,
    compute_matrix_exchange,
    compute_matrix_ownership,
)

SHAPES, IS_MATRIX = [(12, 8), (10, 8), (100,)], [True, True, False]


def _piece(index, start, end):
    return ExchangePiece(index, start, end)


P0, P1 = (lambda s, e: _piece(0, s, e)), (lambda s, e: _piece(1, s, e))

# (dp, R) -> per position: (sends per destination, receives per source, owned)
GOLDEN = [
    pytest.param(1, 1, [(((P0(0, 96), P1(0, 80)),), ((P0(0, 96), P1(0, 80)),), (0, 1))], id="dp1-all-local"),
    pytest.param(2, 1, [
        (((), (P1(0, 64),)), ((), (P0(0, 96),)), (0,)),
        (((P0(0, 96),), (P1(64, 80),)), ((P1(0, 64),), (P1(64, 80),)), (1,)),
    ], id="dp2-p1-straddles"),
    pytest.param(4, 2, [  # m = 2: each instance as dp2
        (((), (P1(0, 64),)), ((), (P0(0, 96),)), (0,)),
        (((P0(0, 96),), (P1(64, 80),)), ((P1(0, 64),), (P1(64, 80),)), (1,)),
    ], id="dp4-R2"),
    pytest.param(4, 1, [
        (((), (), (), ()), ((), (), (P0(0, 32),), (P0(32, 96),)), (0,)),
        (((), (P1(0, 64),), (), ()), ((), (P1(0, 64),), (P1(64, 80),), ()), (1,)),
        (((P0(0, 32),), (P1(64, 80),), (), ()), ((), (), (), ()), ()),
        (((P0(32, 96),), (), (), ()), ((), (), (), ()), ()),
    ], id="dp4-both-straddle-two-own-nothing"),
]


def _plans(dp, instances, shapes=SHAPES, is_matrix=IS_MATRIX, row_splits=None, bucket_size=None):
    topology = DataParallelTopology(dp, instances)
    m = topology.intra_distributed_optimizer_instance_size
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    layout = compute_buffer_layout(numels, bucket_size=bucket_size, data_parallel_world_size=m,
                                   use_distributed_optimizer=True)
    ownership = compute_matrix_ownership(shapes, is_matrix, topology, row_splits=row_splits)
    return layout, ownership, [compute_matrix_exchange([layout], ownership, p) for p in range(m)]


@pytest.mark.parametrize("dp, instances, expected", GOLDEN)
def test_golden_exchange(dp, instances, expected):
    """By hand (module docstring). Would catch a piece sent to the wrong owner, a straddling matrix's piece
    dropped or sent twice, the bias (not a matrix) sent, pieces in another order than the owner's matrices by
    index, receives out of source order, or the instance size taken as dp instead of dp / R."""
    layout, ownership, plans = _plans(dp, instances)
    assert layout.param_ranges == ((256, 352, 0), (128, 208, 0), (0, 100, 0))
    assert [(plan.sends, plan.receives, plan.owned) for plan in plans] == expected
    for plan, (sends, receives, _) in zip(plans, expected):
        assert plan.send_splits == tuple(sum(p.numel for p in pieces) for pieces in sends)
        assert plan.recv_splits == tuple(sum(p.numel for p in pieces) for pieces in receives)
    if dp == 4 and instances == 1:
        assert [plan.send_splits for plan in plans] == [(0, 0, 0, 0), (0, 64, 0, 0), (32, 16, 0, 0), (64, 0, 0, 0)]
        assert [plan.recv_splits for plan in plans] == [(0, 0, 32, 64), (0, 64, 16, 0), (0,) * 4, (0,) * 4]


def test_two_buffers_are_indexed_concatenated():
    """Two buffers (e.g. a bf16 and an fp32 one): the ownership indexes layout 0's parameters, then layout 1's.
    Would catch a second buffer's indices not offset (its matrix taken for the first buffer's parameter 0)."""
    topology = DataParallelTopology(2)
    first = compute_buffer_layout([96, 100], bucket_size=None, data_parallel_world_size=2,
                                  use_distributed_optimizer=True)
    second = compute_buffer_layout([80], bucket_size=None, data_parallel_world_size=2, use_distributed_optimizer=True)
    # global: 0 = 12 x 8 (first buffer), 1 = bias (first), 2 = 10 x 8 (second buffer, alone: [0, 80) of 128)
    ownership = compute_matrix_ownership([(12, 8), (100,), (10, 8)], [True, False, True], topology)
    assert ownership.owner == (0, None, 1)
    plans = [compute_matrix_exchange([first, second], ownership, p) for p in range(2)]
    # first buffer: bias [0, 100), 12 x 8 at [128, 224) of 256: shard 0 [0, 128) has none of it, shard 1 all
    # second buffer: 10 x 8 at [0, 80) of 128: shard 0 [0, 64) -> [0, 64), shard 1 [64, 128) -> [64, 80)
    assert plans[0].sends == ((), (_piece(2, 0, 64),))
    assert plans[1].sends == ((_piece(0, 0, 96),), (_piece(2, 64, 80),))
    assert plans[0].receives == ((), (_piece(0, 0, 96),)) and plans[0].owned == (0,)
    assert plans[1].receives == ((_piece(2, 0, 64),), (_piece(2, 64, 80),)) and plans[1].owned == (2,)
    with pytest.raises(ValueError, match="the layouts hold 2 parameters, the matrix ownership 3"):
        compute_matrix_exchange([first], ownership, 0)
    with pytest.raises(ValueError, match="position must be in"):
        compute_matrix_exchange([first, second], ownership, 2)


def _check_plans(layouts, ownership, plans, numels):
    """The properties every plan must have (see test_exchange_properties)."""
    m = len(plans)
    for p, plan in enumerate(plans):
        assert plan.position == p and len(plan.sends) == len(plan.receives) == m
        assert plan.owned == ownership.owned(p)
        for q in range(m):  # what p sends q is what q expects from p, in the same order
            assert plan.sends[q] == plans[q].receives[p]
            assert all(ownership.owner[piece.param_index] == q for piece in plan.sends[q])
        # p sends exactly its shard's pieces of the matrices (the buffer layout's owned ranges), each once
        sent = sorted((piece.param_index, piece.param_start, piece.param_end) for pieces in plan.sends
                      for piece in pieces)
        owned, offset = [], 0
        for layout in layouts:
            for r in layout.owned_ranges(m, p):
                if ownership.owner[offset + r.param_index] is not None:
                    owned.append((offset + r.param_index, r.param_start, r.param_end))
            offset += len(layout.param_ranges)
        assert sent == sorted(owned)
        for q in range(m):  # ... and to each owner by matrix index
            indices = [piece.param_index for piece in plan.sends[q]]
            assert indices == sorted(indices)
    for index, owner in enumerate(ownership.owner):  # the pieces at the owner tile the matrix exactly once
        if owner is None:
            assert all(piece.param_index != index for plan in plans for pieces in plan.sends for piece in pieces)
            continue
        ranges = sorted((piece.param_start, piece.param_end) for pieces in plans[owner].receives for piece in pieces
                        if piece.param_index == index)
        covered = 0
        for start, end in ranges:
            assert start == covered and end > start, (index, ranges)
            covered = end
        assert covered == numels[index]


@pytest.mark.parametrize("dp, instances", [(1, 1), (2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("bucket_size", [None, 300])
def test_exchange_properties(dp, instances, bucket_size):
    """Random models (seeded; matrices, vectors, empty matrices, fused QKV-like row splits) in one or two
    buffers, several buckets: every matrix's pieces at its owner tile it exactly once, whatever the straddling
    and padding; p's sends to q are q's receives from p, piece for piece in the same order (the two
    all-to-alls' splits agree); a position sends exactly its owned ranges of the matrices, and nothing of a
    parameter that is not one. Would catch a piece lost, duplicated, routed to a non-owner, or an order that
    depends on the position asking."""
    topology = DataParallelTopology(dp, instances)
    m = topology.intra_distributed_optimizer_instance_size
    rng = random.Random(100 * dp + 10 * instances + (bucket_size is None))
    for _ in range(30):
        shapes = [rng.choice([(rng.randint(0, 20), rng.randint(1, 20)), (rng.randint(1, 90),)])
                  for _ in range(rng.randint(1, 8))]
        is_matrix = [len(shape) == 2 and rng.random() < 0.8 for shape in shapes]
        splits = [[shape[0] // 2, shape[0] - shape[0] // 2] if matrix and shape[0] >= 2 and rng.random() < 0.3
                  else None for shape, matrix in zip(shapes, is_matrix)]
        numels = [int(torch.Size(shape).numel()) for shape in shapes]
        cut = rng.randint(0, len(shapes))
        layouts = [compute_buffer_layout(part, bucket_size=bucket_size, data_parallel_world_size=m,
                                         use_distributed_optimizer=True)
                   for part in (numels[:cut], numels[cut:]) if part]
        ownership = compute_matrix_ownership(shapes, is_matrix, topology, row_splits=splits)
        plans = [compute_matrix_exchange(layouts, ownership, p) for p in range(m)]
        _check_plans(layouts, ownership, plans, numels)


def test_gpt_layout_exchange():
    """The GPT's parameters (test_layout's GPT_SHAPES, split QKV) in small buckets at dp 4 R 2: the properties
    hold on a real model's layout with several buckets and padding, and each position's Newton-Schulz work is
    its ownership's load (the plan assembles exactly the matrices it owns)."""
    from test_layout import GPT_MATRIX, GPT_QKV_SPLITS, GPT_SHAPES

    topology = DataParallelTopology(4, 2)
    numels = [int(torch.Size(shape).numel()) for shape in GPT_SHAPES]
    layout = compute_buffer_layout(numels, bucket_size=20000, data_parallel_world_size=2,
                                   use_distributed_optimizer=True)
    assert len(layout.buckets) > 1
    ownership = compute_matrix_ownership(GPT_SHAPES, GPT_MATRIX, topology, row_splits=GPT_QKV_SPLITS)
    plans = [compute_matrix_exchange([layout], ownership, p) for p in range(2)]
    _check_plans([layout], ownership, plans, numels)
    assert [plan.owned for plan in plans] == [(2, 3, 5, 11), (6, 8, 9, 12)]


@pytest.mark.parametrize("dp, instances", [(2, 1), (3, 1), (4, 2)])
def test_exchange_simulated_brings_whole_matrices_and_back(dp, instances):
    """The plan driven by hand over tensors (the two all-to-alls simulated by slicing the send buffers): each
    owner sees the whole matrix exactly as the flat buffer holds it, applies a function of the whole matrix
    (not elementwise: rows mixed), and every position gets back, in its own pieces, that function's values.
    Would catch a receive buffer cut in another order than the sender's, or pieces returned to the wrong place."""
    shapes = [(12, 8), (10, 8), (100,), (3, 40), (7, 7)]
    is_matrix = [True, True, False, True, True]
    topology = DataParallelTopology(dp, instances)
    m = topology.intra_distributed_optimizer_instance_size
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    layout = compute_buffer_layout(numels, bucket_size=150, data_parallel_world_size=m, use_distributed_optimizer=True)
    ownership = compute_matrix_ownership(shapes, is_matrix, topology)
    plans = [compute_matrix_exchange([layout], ownership, p) for p in range(m)]
    values = {i: torch.randn(shapes[i], generator=torch.Generator().manual_seed(i)) for i in range(len(shapes))}

    def whole_function(x):
        return x.flip(0) * x.sum(0, keepdim=True)

    def flat(i):
        return values[i].reshape(-1)

    sent = [[torch.cat([flat(p.param_index)[p.param_start:p.param_end] for p in pieces] + [torch.zeros(0)])
             for pieces in plan.sends] for plan in plans]
    results = {}
    for q, plan in enumerate(plans):
        received = torch.cat([sent[p][q] for p in range(m)])
        assert received.numel() == sum(plan.recv_splits)
        wholes, offset = {i: torch.full((numels[i],), float("nan")) for i in plan.owned}, 0
        for pieces in plan.receives:
            for piece in pieces:
                wholes[piece.param_index][piece.param_start:piece.param_end] = received[offset:offset + piece.numel]
                offset += piece.numel
        for i in plan.owned:
            assert torch.equal(wholes[i].view(shapes[i]), values[i])
            results[i] = whole_function(wholes[i].view(shapes[i])).reshape(-1)
    # the way back: q returns to p the pieces it received from p, in that order; p cuts them by its sends to q
    returned = [[torch.cat([results[x.param_index][x.param_start:x.param_end] for x in pieces] + [torch.zeros(0)])
                 for pieces in plan.receives] for plan in plans]
    for p, plan in enumerate(plans):
        for q, pieces in enumerate(plan.sends):
            back, offset = returned[q][p], 0
            for piece in pieces:
                expected = whole_function(values[piece.param_index]).reshape(-1)[piece.param_start:piece.param_end]
                assert torch.equal(back[offset:offset + piece.numel], expected)
                offset += piece.numel
            assert offset == back.numel()
