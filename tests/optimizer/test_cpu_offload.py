"""optimizer_cpu_offload (megatron_lite/optimizer/cpu_offload.py): main params and optimizer state in host
memory. On this CPU-only machine the host *is* the model's device, yet the offloaded path is the same: the
main params are separate fp32 copies (never the model's storage), the gradients are staged into host
buffers after unscale / clip, and the update is copied back. tests/cuda covers the device-to-host copies."""

import pytest
import torch
from distributed_helper import run_distributed

LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 4
STRATEGIES = ["no_shard", "optim", "optim_grads_params"]


def _ddp_config(strategy):
    extra = dict(fsdp_unit_modules=("Linear", "LayerNorm")) if strategy == "optim_grads_params" else {}
    return dict(use_distributed_optimizer=strategy != "no_shard", overlap_grad_reduce=True, bucket_size=100,
                data_parallel_sharding_strategy=strategy, **extra)


def _offload_worker(strategy, fraction, dtype_name):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps, reference_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    master, _, ref_norms = reference_steps(dp, STEPS, LR, WD, CLIP, dtype=dtype, kernel="fused")
    model, ddp, opt = build(
        dict(_ddp_config(strategy), grad_reduce_in_fp32=dtype != torch.float32),
        dict(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=strategy != "no_shard",
             bf16=dtype == torch.bfloat16, params_dtype=dtype, optimizer_cpu_offload=True,
             optimizer_offload_fraction=fraction),
        dtype=dtype,
    )
    mains = [s.main for s in opt.shard_state.main_shards]
    model_storage = {p.data_ptr() for p in model.parameters()} | {
        b.param_data.data_ptr() for b in ddp.param_and_grad_buffers if b.param_data is not None}
    copies = sum(1 for m in mains if m.data_ptr() not in model_storage and
                 not any(m.data_ptr() == s.params.data_ptr() for s in getattr(opt, "shards", [])))
    norms = [n for _, n in megatron_steps(ddp, opt, rank, dp, STEPS, dtype=dtype)]
    with ddp.full_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.state_dict()["state"]
    return copies, len(mains), norms, ref_norms, params, dict(master.named_parameters()), state


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_optimizer_matches_torch_adamw(strategy, fraction, dtype_name):
    """Would catch an offloaded update that never reaches the model (an fp32 main copy not written back),
    gradients staged before the unscale / clip (or not at all: a step on stale or None grads), a fraction
    that offloads nothing or everything, and state that the torch format cannot read back."""
    for copies, mains, norms, ref_norms, params, master, state in run_distributed(
            _offload_worker, 2, strategy, fraction, dtype_name):
        if dtype_name == "fp32":  # a main param that is not the model's storage is an offloaded copy
            assert (copies == mains) if fraction == 1.0 else (0 < copies < mains), (copies, mains)
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        for name, q in master.items():
            q = q.detach()
            if dtype_name == "fp32":
                exact = strategy == "no_shard"
                assert torch.equal(params[name], q) if exact else torch.allclose(params[name], q, rtol=1e-6,
                                                                                 atol=1e-7), name
            else:
                assert torch.allclose(params[name].float(), q.to(torch.bfloat16).float(), rtol=2**-8, atol=1e-6)
                assert torch.allclose(state[name]["param"], q, rtol=1e-5, atol=1e-7), name


def _resume_worker(strategy):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    from megatron_lite import OptimizerConfig, get_megatron_optimizer

    rank, dp = dist.get_rank(), dist.get_world_size()
    opt_kwargs = dict(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=strategy != "no_shard",
                      optimizer_cpu_offload=True)
    runs = []
    for resume in (False, True):
        torch.manual_seed(0)
        model, ddp, opt = build(_ddp_config(strategy), opt_kwargs)
        megatron_steps(ddp, opt, rank, dp, 2)
        if resume:  # the rank's own shards into a fresh offloaded optimizer (torch_dist / last words' path)
            described = opt.sharded_state()
            shards = {(s.name, s.start): {k: v.clone() for k, v in s.tensors.items()} for s in described.shards}
            fresh = get_megatron_optimizer(OptimizerConfig(**opt_kwargs), [ddp])
            fresh.load_common_state_dict(described.common)
            fresh.load_sharded_state(fresh.sharded_state().with_values(shards, described.step,
                                                                        described.lagging_steps()))
            opt = fresh
        megatron_steps(ddp, opt, rank, dp, 2, first_step=2)
        with ddp.full_parameters():
            runs.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_state_round_trips_exactly(strategy):
    """Would catch host-resident moments or main params that the sharded description misses or loads
    onto the wrong device (a resume that is not bit-exact)."""
    assert all(run_distributed(_resume_worker, 2, strategy))


def test_offload_fraction_is_validated():
    """Would catch a fraction outside [0, 1] silently clamped (or offloading nothing)."""
    from megatron_lite import OptimizerConfig

    with pytest.raises(ValueError, match="optimizer_offload_fraction"):
        OptimizerConfig(lr=1.0, optimizer_cpu_offload=True, optimizer_offload_fraction=1.5)
