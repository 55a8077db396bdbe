"""Fine-tuning: optimizer.reload_model_params() after weights are written into the model, and pretrain_gpt.py's
--finetune / --no-load-optim / --no-load-rng (Megatron's semantics: which parts of a checkpoint are loaded)."""

import os
import sys

import pytest
import torch

from distributed_helper import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
NEW_WEIGHTS_SEED = 7  # the "pretrained" weights written into a model initialised with seed 0


# ------------------------------------------------------------------------------------------ reload_model_params
def _build(strategy, dtype, seed=0):
    from ddp_testing import make_model
    from optim_testing import build

    ddp_kwargs = dict(data_parallel_sharding_strategy=strategy, bucket_size=40, overlap_grad_reduce=True,
                      grad_reduce_in_fp32=True)
    if strategy == "optim_grads_params":
        ddp_kwargs["fsdp_unit_modules"] = ()  # SmallNet has no layer list: one unit, the whole model
    opt_kwargs = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.05, use_distributed_optimizer=strategy != "no_shard",
                      bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return build(ddp_kwargs, opt_kwargs, dtype=dtype, model=make_model(seed, dtype))[1:]


def _weights(ddp):
    ddp.finish_param_sync()
    return {k: v.clone() for k, v in ddp.state_dict().items()}  # ZeRO-3: gathered


def _reload_worker(strategy, dtype_name):
    """(a) an optimizer built before the weights were loaded, then reload_model_params(), vs an optimizer
    built on the loaded model: 3 steps; (b) after 2 steps, load + reload: main params become the new weights,
    moments and step counts stay."""
    import torch.distributed as dist

    from ddp_testing import make_model
    from optim_testing import full_state, megatron_steps, states_equal

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    new = make_model(NEW_WEIGHTS_SEED, dtype).state_dict()

    ddp, opt = _build(strategy, dtype)
    ddp.load_state_dict(new)  # ZeRO-3: through the wrapper, which writes the shards
    opt.reload_model_params()
    megatron_steps(ddp, opt, rank, dp, 3, dtype=dtype)
    ref_ddp, ref_opt = _build(strategy, dtype, seed=NEW_WEIGHTS_SEED)
    megatron_steps(ref_ddp, ref_opt, rank, dp, 3, dtype=dtype)
    fresh = dict(weights=all(torch.equal(a, b) for a, b in zip(_weights(ddp).values(), _weights(ref_ddp).values())),
                 state=states_equal(full_state(opt), full_state(ref_opt)))

    ddp, opt = _build(strategy, dtype)
    megatron_steps(ddp, opt, rank, dp, 2, dtype=dtype)
    before = full_state(opt)
    ddp.load_state_dict(new)
    opt.reload_model_params()
    after = full_state(opt)
    expected_params = {name: new[name].float() for name in after}
    kept = dict(params=all(torch.equal(after[n]["param"], expected_params[n]) for n in after),
                moments=all(torch.equal(after[n][k], before[n][k]) for n in after for k in after[n] if k != "param"),
                step=opt.update_count == 2)
    return fresh, kept


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_reload_model_params_starts_from_the_loaded_weights(strategy, dtype_name):
    """Weights loaded into the model after the optimizer was built: after reload_model_params() the steps are
    bitwise those of an optimizer built on the loaded model (every optimizer: FP32Optimizer, the bf16 one
    with fp32 main copies, the distributed optimizer on ZeRO-1/2/3). Would catch stale fp32 main params
    (the old weights written back over the loaded ones at the next step), a ZeRO-3 shard not refreshed, or
    a reload that drops the moments (megatron-core keeps them)."""
    for fresh, kept in run_distributed(_reload_worker, 2, strategy, dtype_name):
        assert fresh == dict(weights=True, state=True), fresh
        assert kept == dict(params=True, moments=True, step=True), kept
