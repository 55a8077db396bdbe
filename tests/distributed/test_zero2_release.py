"""ZeRO-2 (data_parallel_sharding_strategy='optim_grads') frees a bucket's full-size gradients only once its
reduce-scatter has delivered: buckets of several parameters, with and without overlap, checked by value
against torch DDP + AdamW.

On CPU, gloo's asynchronous all-reduce (what collectives.reduce_scatter runs on gloo) often finishes before
the bucket is looked at again, so a release that comes too early (before wait()) may go unnoticed, or may
corrupt memory at random. The rank function therefore replaces collectives.reduce_scatter with a transport
that is asynchronous for real: it sends a copy of the bucket taken at launch and delivers the reduced
values into the bucket only in wait(), after checking that the bucket's storage is still there. Code that
reads the shard before wait() sees the unreduced gradients (wrong values); code that frees the storage
before wait() gets a RuntimeError naming the problem on every rank (instead of a write into freed memory).
A synchronous launch (no overlap) is done on return, so there an early release is harmless and passes.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed_helper import run_distributed


class Tower(nn.Module):
    """Equal-sized layers: with overlap, bucket_size=100 and the 64-element parameter alignment every bucket
    holds two or three parameters; without overlap there is one bucket of all twelve."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


class _Delivered:
    """Handle of the deferred transport: wait() delivers the reduced copy into the bucket, once."""

    def __init__(self, work, sent, bucket):
        self.work, self.sent, self.bucket = work, sent, bucket

    def wait(self):
        if self.sent is None:
            return True
        self.work.wait()
        needed = (self.bucket.storage_offset() + self.bucket.numel()) * self.bucket.element_size()
        if self.bucket.untyped_storage().nbytes() < needed:
            # Writing into it would be a write into freed memory (a segfault, or silently lost gradients).
            raise RuntimeError("the bucket's gradient storage was released while its reduce-scatter was in "
                               "flight (before wait())")
        self.bucket.copy_(self.sent)
        self.sent = None
        return True

    def is_completed(self):
        return self.sent is None


def _deferred(real):
    def reduce_scatter(bucket, group=None, op=dist.ReduceOp.SUM, async_op=False):
        if not async_op:  # done on return: nothing can come too early
            return real(bucket, group, op, async_op)
        sent = bucket.detach().clone()  # what the transport took at launch
        work = real(sent, group, op, async_op)
        return _Delivered(work, sent, bucket)
    return reduce_scatter


def _worker(overlap, micro_batches, steps=3):
    import copy

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.distributed import collectives
    from megatron_lite.distributed.grad_sync import ZERO2_BUCKETS_IN_FLIGHT

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Tower()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=overlap, bucket_size=100))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                 use_distributed_optimizer=True), ddp)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    buckets = ddp.param_and_grad_buffers[0].buckets
    layout = [len(b.params_list) for b in buckets]
    gen = torch.Generator().manual_seed(10 + rank)
    real = collectives.reduce_scatter
    collectives.reduce_scatter = _deferred(real)
    try:
        for _ in range(steps):
            batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen))
                       for _ in range(micro_batches)]
            ddp.zero_grad_buffer()
            torch_opt.zero_grad()
            for i, (x, y) in enumerate(batches):
                last = i == micro_batches - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (((ddp(x) - y) ** 2).mean() / micro_batches).backward()
                with contextlib.nullcontext() if last else reference.no_sync():
                    (((reference(x) - y) ** 2).mean() / micro_batches).backward()
            ddp.finish_grad_sync()
            freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in buckets)
            opt.step()
            torch_opt.step()
    finally:
        collectives.reduce_scatter = real
    theirs = dict(reference.module.named_parameters())
    diffs = {n: (p.detach() - theirs[n]).abs().max().item() for n, p in model.named_parameters()}
    return dict(layout=layout, window=ZERO2_BUCKETS_IN_FLIGHT, freed=freed, diffs=diffs)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
def test_zero2_releases_gradients_only_after_the_reduce_scatter(overlap, micro_batches):
    """Would catch ZeRO-2 releasing a bucket's full-size gradients (or taking this rank's reduced shard out
    of them) right after launching the reduce-scatter instead of after waiting for it (Bucket.finish_grad_sync
    with the release moved above communication_handle.wait(), or a release in start_grad_sync): the shard
    then holds the unreduced local gradients, or the collective writes into freed storage. With overlap the
    oldest buckets are waited for during backward (the in-flight window), the others in finish_grad_sync;
    without it, launch and wait are back to back. Also the values over several steps (AdamW on the kept
    shards, the storage re-grown and zeroed each iteration, accumulation across no_sync micro-batches):
    bitwise torch DDP + AdamW."""
    for result in run_distributed(_worker, 2, overlap, micro_batches):
        if overlap:  # multi-parameter buckets, more than the in-flight window
            assert all(2 <= n <= 3 for n in result["layout"]), result["layout"]
            assert len(result["layout"]) > result["window"] + 1, result["layout"]
        else:  # megatron's rule: without overlap one bucket holds every parameter
            assert result["layout"] == [12], result["layout"]
        assert result["freed"]
        assert max(result["diffs"].values()) == 0.0, result["diffs"]
