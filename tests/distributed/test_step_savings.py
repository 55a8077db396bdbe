"""The step's savings (issue 13) change no number: gradient_as_bucket_view (autograd accumulates straight
into main_grad) and log_grad_norm=False (no norm pass when not clipping)."""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed
from optim_testing import full_state, states_equal
from test_ddp_errors import _FusedWgradLinear


def _bucket_view_worker(strategy, overlap):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    runs, aliased = {}, {}
    for view in (False, True):
        _, ddp, opt = build(dict(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap, bucket_size=40,
                                 gradient_as_bucket_view=view),
                            dict(lr=1e-2, clip_grad=0.5, use_distributed_optimizer=strategy != "no_shard"))
        norms = megatron_steps(ddp, opt, dist.get_rank(), dist.get_world_size(), 3)  # 2 micro-batches each
        runs[view] = (full_state(opt), norms)
        ddp.zero_grad_buffer()
        ddp(torch.zeros(1, 8))
        aliased[view] = sum(p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr()
                            for p in ddp.param_to_name)
    same = states_equal(runs[True][0], runs[False][0])
    return same and runs[True][1] == runs[False][1], aliased, len(ddp.param_to_name)


@pytest.mark.parametrize("strategy, overlap", [("no_shard", True), ("no_shard", False), ("optim", True),
                                               ("optim_grads", True)])
def test_gradient_as_bucket_view_is_bit_identical(strategy, overlap):
    """Would catch a gradient added twice (autograd already accumulated into the buffer, then the hook adds
    .grad again), lost across no_sync micro-batches, or an alias into a ZeRO-2 storage that is freed."""
    for same, aliased, n_params in run_distributed(_bucket_view_worker, 2, strategy, overlap):
        assert same
        assert aliased[False] == 0
        assert aliased[True] == (0 if strategy == "optim_grads" else n_params)  # ZeRO-2 keeps the copying path


class _FusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return _FusedWgradLinear.apply(x, self.weight)  # adds into main_grad itself, returns a dummy


def _fused_worker():
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(_FusedLayer(), DistributedDataParallelConfig(gradient_as_bucket_view=True))
    ddp.zero_grad_buffer()
    try:
        ddp(torch.randn(4, 5)).sum().backward()
    except ValueError as e:
        return str(e)
    return None


def test_gradient_as_bucket_view_refuses_fused_wgrad_layers():
    """Would catch a fused layer's dummy gradient silently added into main_grad through the alias."""
    for message in run_distributed(_fused_worker, 2):
        assert message and "weight" in message and "gradient_as_bucket_view=False" in message


def _norm_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    out = {}
    for log in (True, False):
        _, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-2, clip_grad=0.0, log_grad_norm=log,
                                                                        use_distributed_optimizer=True))
        out[log] = (megatron_steps(ddp, opt, dist.get_rank(), dist.get_world_size(), 2), full_state(opt))
    same = states_equal(out[False][1], out[True][1])
    return same, [n for _, n in out[False][0]], [n for _, n in out[True][0]]


def test_no_norm_pass_without_clipping_when_not_logged():
    """Would catch a norm still computed (and all-reduced) with log_grad_norm=False and clip_grad=0, or an
    update that depended on it."""
    for same, skipped, logged in run_distributed(_norm_worker, 2):
        assert same and skipped == [None, None] and all(n > 0 for n in logged)
