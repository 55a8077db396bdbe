"""The data-parallel wrapper and the optimizers on CUDA tensors: every sharding strategy, with and without
overlap of the gradient reduction and of the parameter gather, fp32 and bf16, several distributed-optimizer
instances. Two flavours (cuda_ranks.FLAVOURS): NCCL at world size 1, and 2 gloo ranks sharing the GPU (the
collectives really run, on CUDA tensors). Skipped without a GPU.

Tolerances: fp32 against the single-process reference that replays the ranks' arithmetic (ddp_testing.
reference_grads) 1e-6 of the largest gradient (bit-exact on CPU; CUDA kernels are not guaranteed to be), and
1e-5 against the gradient of the whole global batch in one pass; bf16 gradients 1e-2 (rank arithmetic) and
5e-2 (global batch) of the largest gradient: bf16 keeps 8 bits, and the accumulation over micro-batches
rounds once per micro-batch."""

import copy

import pytest
import torch
from cuda_ranks import FLAVOURS, ON_CPU, cuda_or_dry_run, run_on_cuda

pytestmark = pytest.mark.skipif(not cuda_or_dry_run(), reason="needs a CUDA device")

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOLERANCE = {"float32": (1e-6, 1e-5), "bfloat16": (1e-2, 5e-2)}  # (rank arithmetic, global batch)


def _ddp_config(strategy, overlap, **extra):
    from megatron_lite import DistributedDataParallelConfig

    zero3 = strategy == "optim_grads_params"
    return DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap,
                                         bucket_size=64 if overlap else None,
                                         fsdp_unit_modules=("Linear",) if zero3 else None, **extra)


def _grads_worker(strategy, overlap, dtype_name, grad_reduce_in_fp32):
    import torch.distributed as dist
    from cuda_testing import cuda_batches, device, max_rel_diff, reduced_and_expected
    from ddp_testing import global_batch_grads, make_model, reference_grads, train_step

    from megatron_lite import DistributedDataParallel

    dtype = getattr(torch, dtype_name)
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = make_model(dtype=dtype).to(device())
    batches = cuda_batches(dp, 2, dtype=dtype)
    grad_dtype = torch.float32 if grad_reduce_in_fp32 else dtype
    by_rank = reference_grads(model, batches, grad_dtype, average_in_collective=False)
    whole = global_batch_grads(model, batches)
    ddp = DistributedDataParallel(copy.deepcopy(model), _ddp_config(strategy, overlap,
                                                                     grad_reduce_in_fp32=grad_reduce_in_fp32))
    out = {}
    for iteration in range(3):  # the first learns the expected arrivals; later ones launch from the hooks
        train_step(ddp, batches, rank)
        actual, expected = reduced_and_expected(ddp, by_rank)
        _, global_expected = reduced_and_expected(ddp, whole)
        out[iteration] = dict(rank=max_rel_diff(actual, expected),
                              exact=torch.equal(actual, expected.to(grad_dtype).float()),
                              whole=max_rel_diff(actual, global_expected), finite=bool(torch.isfinite(actual).all()))
    out["devices"] = sorted({str(t.device.type) for b in ddp.param_and_grad_buffers
                             for t in ([b.grad_data] if b.grad_data is not None else [])
                             + ([b.param_data] if b.param_data is not None else [])})
    return out


@pytest.mark.parametrize("backend, world", FLAVOURS)
@pytest.mark.parametrize("dtype_name, grad_reduce_in_fp32", [("float32", False), ("bfloat16", False),
                                                              ("bfloat16", True)])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reduced_gradients_match_the_reference(strategy, overlap, dtype_name, grad_reduce_in_fp32, backend, world):
    """Every strategy's reduced gradients (whole, or this rank's shard) on CUDA equal the single-process
    reference, three iterations in a row (the first launches everything in finish_grad_sync, the later ones
    from the grad hooks with overlap). Would catch a CUDA-only mistake in the buffers or buckets (a CPU tensor
    in the reduction path, a ZeRO-2 gradient storage regrown without zeroing on CUDA, a collective that misses
    a stream dependency and reads a bucket before the backward wrote it), bf16 gradients that gloo or NCCL
    reduce wrongly, or a scaling (1/dp) lost on this path."""
    if strategy == "optim_grads_params" and not overlap:
        pytest.skip("ZeRO-3 needs overlap_grad_reduce")
    tight = TOLERANCE["float32" if grad_reduce_in_fp32 else dtype_name][0]  # the grad dtype's rounding
    loose = TOLERANCE[dtype_name][1]  # bf16 parameters: a bf16 backward, whatever the grad dtype
    expected_device = "cpu" if ON_CPU else "cuda"
    for rank, result in enumerate(run_on_cuda(_grads_worker, world, strategy, overlap, dtype_name, grad_reduce_in_fp32,
                                              backend=backend)):
        assert result["devices"] in ([expected_device], []), result["devices"]
        for iteration in range(3):
            r = result[iteration]
            assert r["finite"], (rank, iteration)
            assert r["rank"] <= tight, (rank, iteration, r)
            assert r["whole"] <= loose, (rank, iteration, r)


def _train_worker(dtype_name, configs, steps=3):
    import torch.distributed as dist
    from cuda_testing import device, full_params
    from ddp_testing import make_model
    from optim_testing import megatron_steps

    from megatron_lite import DistributedDataParallel, OptimizerConfig, get_megatron_optimizer

    dtype = getattr(torch, dtype_name)
    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, (strategy, extra) in configs.items():
        sharded = strategy != "no_shard"
        ddp = DistributedDataParallel(make_model(dtype=dtype).to(device()), _ddp_config(strategy, True, **extra))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.05, weight_decay=0.01, clip_grad=1.0,
                                                     bf16=dtype == torch.bfloat16, use_distributed_optimizer=sharded),
                                     [ddp])
        results = megatron_steps(ddp, opt, rank, dp, steps, dtype=dtype, device=device())
        assert all(ok for ok, _ in results)
        out[label] = dict(params=full_params(ddp), norms=[norm for _, norm in results])
    return out


def _train_configs(world):
    configs = {s: (s, dict(overlap_param_gather=s in ("optim", "optim_grads"))) for s in STRATEGIES}
    if world == 2:
        configs["optim, 2 instances"] = ("optim", dict(overlap_param_gather=True,
                                                       num_distributed_optimizer_instances=2))
        configs["optim_grads, 2 instances"] = ("optim_grads", dict(num_distributed_optimizer_instances=2))
    return configs


@pytest.mark.parametrize("backend, world", FLAVOURS)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_training_steps_agree_across_strategies_and_with_the_reference(dtype_name, backend, world):
    """Three optimizer steps (SGD with momentum, weight decay, clipping; 2 micro-batches) under every strategy
    with overlap_grad_reduce, overlap_param_gather where it applies, and (2 ranks) 2 distributed-optimizer
    instances: ZeRO-2 and ZeRO-3 end bit for bit where ZeRO-1 does (as on CPU), instances and plain DDP agree
    to rounding, and all match torch's SGD on the CPU reference (fp32 1e-5, bf16 parameters 1e-2 absolute).
    Would catch a parameter all-gather that the next forward does not wait for on CUDA (stale parameters), a
    ZeRO-3 unit released or regrown out of order, an optimizer (fused CUDA kernels) stepping the wrong shard,
    a grad norm or clip computed on the wrong device, or an instance all-reduce on CUDA that loses a shard."""
    from optim_testing import reference_steps

    dtype = getattr(torch, dtype_name)
    results = run_on_cuda(_train_worker, world, dtype_name, _train_configs(world), backend=backend)
    master, _, ref_norms = reference_steps(world, 3, lr=0.05, weight_decay=0.01, clip_grad=1.0, dtype=dtype, kind="sgd")
    expected = {n: p.detach().to(dtype).float() for n, p in master.named_parameters()}
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for rank, out in enumerate(results):
        base = out["optim"]["params"]
        for label in ("optim_grads", "optim_grads_params"):
            for n in base:
                assert torch.equal(out[label]["params"][n], base[n]), (rank, label, n)
        for label, run in out.items():
            for n, p in run["params"].items():
                torch.testing.assert_close(p, base[n], rtol=0, atol=atol, msg=lambda m: f"{rank} {label} {n}: {m}")
                torch.testing.assert_close(p, expected[n], rtol=0, atol=atol,
                                           msg=lambda m: f"{rank} {label} {n} vs reference: {m}")
            for got, want in zip(run["norms"], ref_norms):
                assert abs(got - want) <= (1e-5 if dtype == torch.float32 else 2e-2) * want, (rank, label, got, want)
