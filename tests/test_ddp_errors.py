"""Unused parameters, NaN/Inf gradients and protocol misuse: clear errors on every rank, never a hang."""

import torch
import torch.nn as nn

from distributed_helper import run_distributed


class WithUnused(nn.Module):
    """`spare` is registered but only used when `use_spare` is set."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.use_spare = False

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.use_spare:
            h = h + self.spare(h)
        return self.out(h)


def _unused_worker(overlap, find_unused, spare_used_on_rank0, iterations=2):
    import copy

    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = WithUnused()
    reference = copy.deepcopy(model)
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=10 if overlap else None, find_unused_parameters=find_unused
    )
    ddp = DistributedDataParallel(model, config)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(dp)]
    uses = [spare_used_on_rank0 and r == 0 for r in range(dp)]
    result = {}
    for iteration in range(iterations):
        ddp.zero_grad_buffer()
        model.use_spare = uses[rank]
        ddp(xs[rank]).pow(2).mean().backward()
        try:
            ddp.finish_grad_sync()
        except ValueError as e:
            result["error"] = str(e)
            return result
    expected = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for r in range(dp):
        reference.zero_grad()
        reference.use_spare = uses[r]
        reference(xs[r]).pow(2).mean().backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[n] += p.grad / dp
    result["exact"] = all(torch.equal(p.main_grad, expected[n]) for n, p in model.named_parameters())
    return result


def test_unused_parameter_with_overlap_is_a_clear_error_on_every_rank():
    """Would catch a hang or a cryptic assert when a registered parameter gets no gradient."""
    for result in run_distributed(_unused_worker, 2, True, False, False):
        msg = result["error"]
        assert "spare.weight" in msg and "spare.bias" in msg and "find_unused_parameters=True" in msg
        assert "fc.weight" not in msg


def test_parameter_unused_on_one_rank_only_errors_there_without_hanging_the_other():
    """Would catch the rank that saw every gradient hanging in a collective its peer never joined."""
    used_rank, unused_rank = run_distributed(_unused_worker, 2, True, False, True, 1)
    assert used_rank == {"exact": True}
    assert "spare.weight" in unused_rank["error"]


def test_find_unused_parameters_gives_the_exact_mean():
    """Unused everywhere, and used on rank 0 only (its mean gradient must be halved, not dropped)."""
    for spare_used_on_rank0 in (False, True):
        results = run_distributed(_unused_worker, 2, True, True, spare_used_on_rank0)
        assert all(r == {"exact": True} for r in results), results


def test_unused_parameter_without_overlap_is_exact():
    """Without overlap everything is reduced in finish_grad_sync: unused grads are simply zero."""
    results = run_distributed(_unused_worker, 2, False, False, True)
    assert all(r == {"exact": True} for r in results), results


def _nan_worker(overlap):
    import torch.distributed as dist

    from ddp_testing import loss_fn, make_batches, make_model
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    model = make_model()
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=50)
    ddp = DistributedDataParallel(model, config)
    x, y = make_batches(dist.get_world_size(), 1)[rank][0]
    messages = []
    for poison in (False, True):
        ddp.zero_grad_buffer()
        if poison and rank == 1:
            with torch.no_grad():
                model.fc1.bias[0] = float("nan")  # NaN reaches fc1's grads (and everything below it)
        loss_fn(ddp, x, y).backward()
        try:
            ddp.finish_grad_sync()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def test_nan_in_one_rank_raises_on_all_ranks_naming_rank_bucket_param():
    """Would catch a silent NaN, or a check that raises on one rank only and leaves the other hanging."""
    for overlap in (False, True):
        (clean0, msg0), (clean1, msg1) = run_distributed(_nan_worker, 2, overlap)
        assert clean0 is None and clean1 is None
        assert msg0 is not None and "rank(s) [1]" in msg0 and "rank 0's local gradients were finite" in msg0
        assert "rank 1 found NaN/Inf" in msg1 and "fc1.bias" in msg1 and "bucket" in msg1


def _misuse_worker():
    from ddp_testing import loss_fn, make_batches, make_model
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(make_model(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=50))
    x, y = make_batches(1, 1)[0][0]
    errors = []
    # 1. The last micro-batch also ran under no_sync().
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        loss_fn(ddp, x, y).backward()
    try:
        ddp.finish_grad_sync()
    except ValueError as e:
        errors.append(str(e))
    # 2. A second backward after finish_grad_sync() without zero_grad_buffer().
    ddp.zero_grad_buffer()
    loss_fn(ddp, x, y).backward()
    ddp.finish_grad_sync()
    try:
        loss_fn(ddp, x, y).backward()
    except RuntimeError as e:
        errors.append(str(e))
    # 3. Two backward passes in the last micro-batch (the bucket was already launched).
    ddp.zero_grad_buffer()
    loss_fn(ddp, x, y).backward()
    try:
        loss_fn(ddp, x, y).backward()
    except RuntimeError as e:
        errors.append(str(e))
    ddp.finish_grad_sync()  # everything was launched once: completes cleanly
    return errors


def test_protocol_misuse_messages():
    for errors in run_distributed(_misuse_worker, 2):
        assert len(errors) == 3
        assert "outside no_sync()" in errors[0]
        assert "zero_grad_buffer()" in errors[1]
        assert "second gradient" in errors[2]
