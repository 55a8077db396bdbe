"""collectives.py is the one place the library communicates: its observer hook sees every collective of a
training step, and no other library module calls torch.distributed's collectives directly."""

import os
import re

import pytest
from distributed_helper import run_distributed
from pretrain_testing import REPO

COLLECTIVE_CALL = re.compile(r"\bdist\.(all_reduce|reduce_scatter\w*|all_gather\w*|broadcast\w*|barrier|"
                             r"all_to_all\w*|send|recv|isend|irecv|reduce|gather|scatter)\(")


def test_no_collective_outside_collectives_module():
    """Would catch a library module that calls torch.distributed directly (its traffic would be invisible to
    collectives.observe, and it would bypass the backend choices made there)."""
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "megatron_lite")):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and not path.endswith(os.path.join("distributed", "collectives.py")):
                for number, line in enumerate(open(path, encoding="utf-8"), 1):
                    if COLLECTIVE_CALL.search(line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _observed_step_worker(use_distributed_optimizer):
    import torch
    from ddp_testing import loss_fn, make_batches
    from optim_testing import build

    from megatron_lite.distributed import collectives

    rank = torch.distributed.get_rank()
    _, ddp, opt = build(dict(use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=True,
                             bucket_size=200),
                        dict(lr=1e-3, use_distributed_optimizer=use_distributed_optimizer))
    x, y = make_batches(2, 1)[rank][0]
    seen = []
    with collectives.observe(lambda name, tensor, size: seen.append((name, tensor.numel(), size))):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        ddp.finish_grad_sync()
        opt.step()
    after = len(seen)
    collectives.all_reduce(torch.zeros(1))  # outside the context: not reported
    buckets = [b.grad_data.numel() for b in ddp.grad_sync.launch_order]
    return seen, after == len(seen), buckets


def test_observe_reports_every_collective_of_a_step():
    """Would catch a bucket collective, the grad-norm reduction or the parameter all-gather issued around
    the observer hook (uncounted traffic in the benchmarks), or an observer that outlives its context."""
    for distributed in (False, True):
        seen, removed, buckets = run_distributed(_observed_step_worker, 2, distributed)[0]
        assert removed
        big = [(name, numel) for name, numel, size in seen if numel > 1]
        # gloo: plain DDP all-reduces each bucket; the distributed optimizer reduce-scatters (at dp=2 by broadcasts)
        reduction = "reduce_scatter" if distributed else "all_reduce"
        expected = [(reduction, n) for n in buckets] + ([("all_gather", n) for n in buckets[::-1]]
                                                        if distributed else [])
        assert big == expected, (distributed, seen)
        assert all(size == 2 for _, _, size in seen)
        assert any(name == "all_reduce" and numel == 1 for name, numel, _ in seen) == distributed  # norm of shards


def _gloo_paths_worker():
    import torch
    import torch.distributed as dist

    from megatron_lite.distributed import collectives

    rank, dp = dist.get_rank(), dist.get_world_size()

    def values(r, k):  # rank r's bucket k: magnitudes that differ by rank, so the order of a sum shows
        return torch.randn(6 * dp, generator=torch.Generator().manual_seed(10 * k + r)) * 10.0 ** (3 * r)

    def mine(t):
        return collectives.shard(t, dp, rank)

    reduce_in, gather_in = [values(rank, k) for k in range(3)], [values(rank, 3 + k) for k in range(2)]
    handles = [collectives.reduce_scatter(t, async_op=True) for t in reduce_in]
    handles += [collectives.all_gather(t, async_op=True) for t in gather_in]  # all five in flight at once
    for handle in handles[::-1]:
        handle.wait()
    ok = []
    for k, t in enumerate(reduce_in):
        total = values(0, k)
        for r in range(1, dp):
            total = total + values(r, k)  # rank order
        untouched = torch.cat([t[:rank * 6], t[(rank + 1) * 6:]])
        ok.append(torch.equal(mine(t), mine(total))
                  and torch.equal(untouched, torch.cat([values(rank, k)[:rank * 6], values(rank, k)[(rank + 1) * 6:]])))
    for k, t in enumerate(gather_in):
        ok.append(torch.equal(t, torch.cat([collectives.shard(values(r, 3 + k), dp, r) for r in range(dp)])))
    return ok


@pytest.mark.parametrize("dp", [2, 3])
def test_gloo_reduce_scatter_and_all_gather_paths(dp):
    """gloo's own paths (dp=2: broadcasts both ways; dp=3: all-to-all reduce-scatter, broadcast all-gather),
    several in flight at once: each shard is bitwise the sum in rank order, the other shards keep the rank's
    values, each gathered bucket is every rank's shard in its place. Would catch pieces paired with the wrong
    collective or rank, a sum in another order (it would differ with these magnitudes), or a wait that returns
    before the transfers are done."""
    assert all(all(ok) for ok in run_distributed(_gloo_paths_worker, dp))


def _all_to_all_worker():
    import torch
    import torch.distributed as dist

    from megatron_lite.distributed import collectives

    world, rank = dist.get_world_size(), dist.get_rank()
    # rank r sends (r + q) % 3 elements to rank q (some zero), valued 100 r + q: uneven splits both ways
    send_splits = [(rank + q) % 3 for q in range(world)]
    recv_splits = [(p + rank) % 3 for p in range(world)]
    data = torch.cat([torch.full((n,), 100.0 * rank + q) for q, n in enumerate(send_splits)])
    out = torch.full((sum(recv_splits),), float("nan"))
    seen = []
    with collectives.observe(lambda name, tensor, size: seen.append(name)):
        collectives.all_to_all_single(out, data, recv_splits, send_splits).wait()
    expected = torch.cat([torch.full((n,), 100.0 * p + rank) for p, n in enumerate(recv_splits)])
    half = torch.empty(out.shape, dtype=torch.bfloat16)  # the dtype Newton-Schulz's results travel back in
    collectives.all_to_all_single(half, data.bfloat16(), recv_splits, send_splits)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    one = torch.empty(2)
    collectives.all_to_all_single(one, torch.tensor([1.0, 2.0]), [2], [2], solo)
    try:
        collectives.all_to_all_single(out, data, recv_splits, send_splits[:-1])
        error = None
    except ValueError as e:
        error = str(e)
    return torch.equal(out, expected) and torch.equal(half, expected.bfloat16()), seen, one.tolist(), error


def test_all_to_all_single_uneven_splits():
    """dp=3 on gloo, uneven splits with empty pieces, fp32 and bf16: each piece arrives from its rank in its
    place; the observer sees it; a one-rank group copies; wrong split counts are a ValueError (not gloo's abort). Would
    catch input and output splits swapped (they differ here), or a call that bypasses the observers."""
    for equal, seen, one, error in run_distributed(_all_to_all_worker, 3):
        assert equal and seen == ["all_to_all"] and one == [1.0, 2.0]
        assert "one split size per rank of the group (3)" in error


def _scratch_worker():
    import time
    import weakref

    import torch

    from megatron_lite.distributed import collectives

    scratches, empty_like = [], torch.empty_like

    def recorded(*args, **kwargs):  # every scratch the collectives allocate, weakly
        out = empty_like(*args, **kwargs)
        scratches.append(weakref.ref(out))
        return out

    buckets = [torch.ones(3_000_000) for _ in range(2)]
    torch.empty_like = recorded
    try:
        handles = [collectives.reduce_scatter(b, async_op=True) for b in buckets]
    finally:
        torch.empty_like = empty_like
    for handle in handles:
        handle.wait()
    # A tensor's Python object outlives its last Python reference while C++ (the work) holds the tensor; gloo's
    # thread may drop its work a moment after marking it complete: allow it that moment, not an iteration.
    deadline = time.monotonic() + 5
    while any(ref() is not None for ref in scratches) and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(scratches), sum(ref() is not None for ref in scratches), len(handles)


def test_reduce_scatter_frees_its_scratch_on_wait():
    """dp=3 (gloo's all-to-all path, a bucket-sized scratch per reduce-scatter): after wait(), with the handles
    still alive (a bucket keeps its handle until its next iteration), the scratches are gone. Would catch a
    handle that keeps the collective's work, which holds its output tensor: every bucket's scratch, a full
    copy of the gradients, alive until the next iteration (as it was until 2026-11-26). Tracked by weak
    references, not RSS (allocator state made an RSS measure flaky under load)."""
    for made, alive, handles in run_distributed(_scratch_worker, 3):
        assert made == handles == 2 and alive == 0, (made, alive)


def _one_rank_worker():
    import torch

    from megatron_lite.distributed import collectives

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    solo = [torch.distributed.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    seen = []
    with collectives.observe(lambda *call: seen.append(call)):
        collectives.all_reduce(torch.ones(4), solo)
        collectives.all_gather(torch.ones(4), solo)
    return seen


def test_one_rank_groups_send_nothing():
    """Would catch collectives on a one-rank group reaching gloo (milliseconds of copying for nothing)."""
    assert run_distributed(_one_rank_worker, 2) == [[], []]


def _rank_zero_first_worker(failing_rank):
    import torch
    import torch.distributed as dist

    from megatron_lite.distributed import collectives

    def build(rank):
        if dist.get_rank() == failing_rank:
            raise OSError(f"injected: rank {failing_rank} cannot read the cache")
        return rank

    try:
        collectives.rank_zero_first(build, 7)
        error = None
    except (OSError, RuntimeError) as e:
        error = str(e)
    in_step = torch.ones(1)
    dist.all_reduce(in_step)  # the ranks are still in step: the same collectives were issued
    return error, int(in_step.item())


def test_rank_zero_first_failure_on_any_rank_reaches_every_rank():
    """Would catch rank_zero_first agreeing only on rank 0's call: a rank failing in the later call (a file
    only it cannot read) would leave the others walking into the next collective, waiting there until the
    process-group timeout, with the cause printed nowhere. And the others' error naming the work they did not
    do ("_nothing failed on rank(s) [0]") instead of the work that failed ("build failed ...")."""
    for failing in (0, 1):
        results = run_distributed(_rank_zero_first_worker, 2, failing)
        assert all(f"injected: rank {failing}" in (error or "") and in_step == 2 for error, in_step in results)
        other = results[1 - failing][0]
        assert other.startswith(f"build failed on rank(s) [{failing}]"), other
