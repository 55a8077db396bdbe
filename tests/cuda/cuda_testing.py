"""Shared pieces of the CUDA tests (imported inside the rank workers of cuda_ranks.py): the device, the
batches of tests/support/ddp_testing.py moved onto it, and the reduced gradients read out of the buffers."""

import os

import torch


def device() -> torch.device:
    """The rank's GPU (the CPU in cuda_ranks.py's dry run)."""
    if os.environ.get("MLITE_CUDA_TESTS_ON_CPU") == "1":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def cuda_batches(dp, micro_batches, seed=1, dtype=torch.float32):
    """ddp_testing.make_batches (drawn on the CPU, so identical to the CPU tests' data), on the GPU."""
    from ddp_testing import make_batches

    batches = make_batches(dp, micro_batches, seed=seed, dtype=dtype)
    return [[(x.to(device()), y.to(device())) for x, y in rank] for rank in batches]


def reduced_and_expected(ddp, reference):
    """(actual, expected), fp32 CPU tensors over what this rank holds reduced: every bucket's whole gradients
    (no_shard), or its shard of them (sharded strategies: ZeRO-1's view into grad_data, ZeRO-2/3's grad_shard).
    `reference`: {parameter name: gradient}. Padding is expected to be zero."""
    actual, expected = [], []
    for buffer in ddp.param_and_grad_buffers:
        flat = torch.zeros(buffer.numel, dtype=torch.float32)
        for param, (start, end, _) in buffer.param_index_map.items():
            flat[start:end] = reference[ddp.param_to_name[param]].reshape(-1).float().cpu()
        for bucket in buffer.buckets:
            if ddp.ddp_config.use_distributed_optimizer:
                mine, start = bucket.reduced_grad_shard, bucket.offset + bucket.shard_offset
            else:
                mine, start = bucket.grad_data, bucket.offset
            assert mine.device.type == device().type, \
                f"bucket {bucket.bucket_id}'s reduced gradients are on {mine.device}"
            actual.append(mine.detach().float().cpu())
            expected.append(flat[start:start + mine.numel()])
    return torch.cat(actual), torch.cat(expected)


def max_rel_diff(actual, expected) -> float:
    """max |actual - expected| / max |expected|: one number per comparison, for tolerances and messages."""
    scale = expected.abs().max().item() or 1.0
    return (actual - expected).abs().max().item() / scale


def full_params(ddp):
    """{name: fp32 CPU copy} of the wrapped model's parameters (ZeRO-3: gathered; pending gathers done)."""
    ddp.finish_param_sync()
    with ddp.full_parameters():
        return {n: p.detach().float().cpu().clone() for n, p in ddp.module.named_parameters()}
