"""The optimizer state dict is independent of DP size, bucket layout and optimizer kind.

Saved by the DistributedOptimizer at dp=2, it is loaded at dp=1, 2 and 4, with other bucket sizes, and by
the non-sharded optimizer; training then continues on the same global batches. Same dp and layout:
bit-exact continuation. Other dp: the gradient sums round differently, so within 1e-5 relative.
"""

import pytest
import torch
from distributed_helper import run_distributed

LR, WD, CLIP = 1e-2, 0.1, 0.05
GLOBAL_MICRO_BATCHES = 4  # per step: micro-batches x dp, kept constant so every dp sees the same samples


def _opt_kwargs(distopt, dtype):
    return dict(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=distopt,
                bf16=dtype == torch.bfloat16, params_dtype=dtype)


def _save_worker(path, dtype_name):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    mbs = GLOBAL_MICRO_BATCHES // dp
    model, ddp, opt = build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40,
                                 grad_reduce_in_fp32=True), _opt_kwargs(True, dtype), dtype=dtype)
    megatron_steps(ddp, opt, rank, dp, 3, micro_batches=mbs, dtype=dtype)
    checkpoint = {"model": ddp.state_dict(), "optimizer": opt.state_dict()}  # collective: every rank calls
    if rank == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    megatron_steps(ddp, opt, rank, dp, 2, micro_batches=mbs, first_step=3, dtype=dtype)
    return [p.detach().float().clone() for p in model.parameters()]


def _resume_worker(path, distopt, bucket_size, dtype_name):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    model, ddp, opt = build(dict(use_distributed_optimizer=distopt, overlap_grad_reduce=True, bucket_size=bucket_size,
                                 grad_reduce_in_fp32=True), _opt_kwargs(distopt, dtype), dtype=dtype)
    checkpoint = torch.load(path, weights_only=True)  # plain tensors and containers: no pickled code
    ddp.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    megatron_steps(ddp, opt, rank, dp, 2, micro_batches=GLOBAL_MICRO_BATCHES // dp, first_step=3, dtype=dtype)
    ddp.finish_param_sync()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_distributed_optimizer_checkpoint_reshards(tmp_path, dtype_name):
    """Would catch state saved with padding or per-rank offsets, shards re-split at the wrong offsets,
    a lost step count (bias correction), and fp32 main params replaced by rounded bf16 params."""
    path = str(tmp_path / "ckpt.pt")
    straight = run_distributed(_save_worker, 2, path, dtype_name)[0]
    cases = [  # (dp, distributed optimizer, bucket size, exact)
        (2, True, 40, True), (1, True, None, False), (4, True, 100, False), (2, False, 40, False),
        (1, False, None, False), (4, True, 1, False),
    ]
    for dp, distopt, bucket_size, exact in cases:
        resumed = run_distributed(_resume_worker, dp, path, distopt, bucket_size, dtype_name)
        for rank_params in resumed:
            for a, b in zip(rank_params, straight):
                if exact:
                    assert torch.equal(a, b), (dp, distopt, bucket_size)
                else:
                    tol = 1e-5 if dtype_name == "float32" else 2**-7
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(),
                                               msg=f"dp={dp} distopt={distopt} bucket_size={bucket_size}")


def _mismatch_worker(path):
    from optim_testing import build

    _, ddp, opt = build(dict(use_distributed_optimizer=False), dict(lr=LR, optimizer="sgd"))
    try:
        opt.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    except ValueError as e:
        return str(e)


def test_loading_a_checkpoint_of_another_optimizer_kind_is_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run_distributed(_save_worker, 2, path, "float32")
    for message in run_distributed(_mismatch_worker, 2, path):
        assert "'adam'" in message and "'sgd'" in message
        assert "OptimizerConfig.optimizer" in message and "--no-load-optim" in message  # what to do
