"""After finish_grad_sync, every rank's main_grad is the data-parallel mean gradient.

Matrix: dp 2 and 4 x overlap on/off x all-reduce / reduce-scatter (distributed-optimizer layout) x
bucket sizes (one param per bucket, buckets cutting the model mid-way, one bucket) x averaging in the
collective on/off x fp32 and bf16 params with fp32 grads, always with 3 micro-batches under no_sync.
Would catch: a missing or double 1/dp scaling, grads lost or double-counted across micro-batches,
a collective reducing the wrong slice, buckets launched before all their grads were accumulated,
padding leaking into gradients, and a buffer mixing up dtypes.
"""

import itertools

import pytest
import torch
from distributed_helper import run_distributed

MICRO_BATCHES = 3


def _run_matrix(overlap, distopt, dtype_name):
    import torch.distributed as dist
    from ddp_testing import (
        compare_to_reference,
        global_batch_grads,
        make_batches,
        make_model,
        reference_grads,
        train_step,
    )

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    batches = make_batches(dp, MICRO_BATCHES, dtype=dtype)
    checked = 0
    for bucket_size, average in itertools.product([1, 200, None], [False, True]):
        model = make_model(dtype=dtype)
        reference_model = make_model(dtype=dtype)
        config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=dtype != torch.float32,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=distopt,
            bucket_size=bucket_size,
            average_in_collective=average,
        )
        ddp = DistributedDataParallel(model, config)
        if overlap and bucket_size == 1:
            assert len(ddp.param_and_grad_buffers[0].buckets) == len(list(model.parameters()))
        for _ in range(2):  # a second iteration checks that zero_grad_buffer resets everything
            train_step(ddp, batches, rank)
        grad_dtype = torch.float32
        ref = reference_grads(reference_model, batches, grad_dtype, average)
        # Same arithmetic as the ranks: bit-exact where only one addition per element is involved.
        compare_to_reference(ddp, ref, exact=dp == 2, rtol=1e-6)
        # Against the textbook global-batch gradient: fp32 rounding-level, bf16 compute at bf16 precision.
        global_ref = global_batch_grads(reference_model, batches)
        compare_to_reference(ddp, global_ref, exact=False, rtol=1e-5 if dtype == torch.float32 else 2e-2)
        checked += 1
    return checked


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("distopt", [False, True], ids=["all-reduce", "reduce-scatter"])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_main_grad_equals_single_process_reference(dp, overlap, distopt, dtype_name):
    results = run_distributed(_run_matrix, dp, overlap, distopt, dtype_name)
    assert results == [6] * dp


def _run_fp32_main_grads_for_bf16(dp_expected):
    """bf16 params without grad_reduce_in_fp32 keep bf16 grads; with it, a separate fp32 grad buffer."""
    import torch.distributed as dist
    from ddp_testing import make_model

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    assert dist.get_world_size() == dp_expected
    out = []
    for fp32 in (False, True):
        ddp = DistributedDataParallel(make_model(dtype=torch.bfloat16),
                                      DistributedDataParallelConfig(grad_reduce_in_fp32=fp32))
        out.append([(str(b.param_dtype), str(b.grad_dtype)) for b in ddp.param_and_grad_buffers])
    return out


def test_grad_dtype_follows_grad_reduce_in_fp32():
    results = run_distributed(_run_fp32_main_grads_for_bf16, 2, 2)
    assert results[0] == [
        [("torch.bfloat16", "torch.bfloat16")],
        [("torch.bfloat16", "torch.float32")],
    ]
