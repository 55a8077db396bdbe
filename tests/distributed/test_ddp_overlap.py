"""Overlap is real, launches happen in one order on every rank, and no_sync really defers communication."""

import torch
import torch.nn as nn
from distributed_helper import run_distributed


class _Recorder:
    """Logs every bucket launch (Bucket.start_grad_sync) next to grad-hook events."""

    def __init__(self, ddp):
        from megatron_lite.distributed import Bucket

        self.events = []
        self._original = original = Bucket.start_grad_sync
        ids = {id(b): (i, b.bucket_id) for i, buf in enumerate(ddp.param_and_grad_buffers) for b in buf.buckets}

        def start_grad_sync(bucket, *args):
            self.events.append(("launch", ids[id(bucket)]))
            return original(bucket, *args)

        Bucket.start_grad_sync = start_grad_sync
        # Registered after DDP's own hooks, so each runs right after DDP has handled that gradient.
        for name, p in ddp.module.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, _n=name: self.events.append(("grad", _n)))

    def restore(self):
        from megatron_lite.distributed import Bucket

        Bucket.start_grad_sync = self._original

    def launches(self):
        return [e[1] for e in self.events if e[0] == "launch"]


def _overlap_worker(distopt):
    import torch.distributed as dist
    from ddp_testing import loss_fn, make_batches, make_model

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    model = make_model()
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=distopt, bucket_size=50)
    ddp = DistributedDataParallel(model, config)
    n_buckets = len(ddp.param_and_grad_buffers[0].buckets)
    batches = make_batches(dist.get_world_size(), 2)[rank]
    # The first iteration learns how many times each gradient arrives per backward (megatron-core's golden
    # counts); its buckets are launched in finish_grad_sync. Overlap starts with the second iteration.
    ddp.zero_grad_buffer()
    loss_fn(ddp, *batches[1]).backward()
    ddp.finish_grad_sync()
    rec = _Recorder(ddp)
    try:
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            loss_fn(ddp, *batches[0]).backward()
        launches_in_no_sync = len(rec.launches())
        last_microbatch_start = len(rec.events)
        loss_fn(ddp, *batches[1]).backward()
        launches_in_backward = rec.launches()
        ddp.finish_grad_sync()
    finally:
        rec.restore()
    first_registered = next(iter(ddp.param_to_name.values()))
    events = rec.events
    first_launch = events.index(("launch", (0, 0)))
    first_param_grad = events.index(("grad", first_registered), last_microbatch_start)
    return dict(
        n_buckets=n_buckets,
        launches_in_no_sync=launches_in_no_sync,
        launches_in_backward=launches_in_backward,
        launched_before_last_grad=first_launch < first_param_grad,
    )


def test_bucket_collectives_start_during_backward():
    """Would catch communication deferred to finish_grad_sync (no overlap) or issued inside no_sync()."""
    for distopt in (False, True):
        for result in run_distributed(_overlap_worker, 2, distopt):
            assert result["n_buckets"] >= 3
            assert result["launches_in_no_sync"] == 0
            # Every bucket was launched from a hook, in buffer order, before finish_grad_sync ...
            assert result["launches_in_backward"] == [(0, b) for b in range(result["n_buckets"])]
            # ... and the first one before the first-registered parameter (last in backward) had its grad.
            assert result["launched_before_last_grad"]


class TwoBranches(nn.Module):
    """Two same-shaped branches; the rank decides which one autograd visits first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.a_first = True

    def forward(self, x):
        if self.a_first:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return torch.tanh(ya) + torch.tanh(yb)


def _order_worker():
    import copy

    import torch.distributed as dist
    from ddp_testing import mean_of_rank_grads

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoBranches()
    model.a_first = rank == 0  # autograd runs the later-built branch first: orders differ per rank
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1))
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(dp)]
    rec = _Recorder(ddp)
    try:
        ddp.zero_grad_buffer()
        ddp(xs[rank]).pow(2).mean().backward()
        ddp.finish_grad_sync()
    finally:
        rec.restore()
    grads = [e[1] for e in rec.events if e[0] == "grad"]
    expected = mean_of_rank_grads(reference, xs)  # mean over ranks of each rank's gradient (dp=2: exact)
    exact = all(torch.equal(p.main_grad, expected[n]) for n, p in model.named_parameters())
    return dict(grad_order=grads, launches=rec.launches(), exact=exact)


def test_launch_order_is_fixed_when_autograd_order_differs_between_ranks():
    """Would catch launching buckets in completion order: with rank-dependent hook order, same-sized
    buckets would silently be summed with the wrong partner bucket on the other rank."""
    r0, r1 = run_distributed(_order_worker, 2)
    assert r0["grad_order"] != r1["grad_order"]  # the scenario really happens
    assert r0["launches"] == r1["launches"] == [(0, b) for b in range(4)]
    assert r0["exact"] and r1["exact"]
