"""Muon's whole-matrix exchange on CUDA tensors (cuda_ranks.FLAVOURS: NCCL at world size 1, two gloo ranks sharing
the GPU, where collectives.all_to_all_single goes through host memory). Skipped without a GPU.

On the CPU the sharded paths equal no_shard bit for bit (tests/optimizer/test_muon_sharded.py). CUDA kernels need
not be deterministic (an embedding's backward adds atomically), and a gradient one bit off can flip a rounding of
the bfloat16 Newton-Schulz: that moves an element by about lr x scale x 2^-8 (~1e-4) per step, so 5e-4 after three
steps. A piece returned to the wrong place or rank moves elements by about lr (2e-2).
"""

import pytest
import torch
from cuda_ranks import FLAVOURS, cuda_or_dry_run, run_on_cuda

pytestmark = pytest.mark.skipif(not cuda_or_dry_run(), reason="needs a CUDA device")

CONFIGS = {  # label -> DDP config
    "no_shard": dict(use_distributed_optimizer=False),
    "optim": dict(use_distributed_optimizer=True, bucket_size=1500, overlap_grad_reduce=True,
                  overlap_param_gather=True),
    "optim_grads_params": dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                               data_parallel_sharding_strategy="optim_grads_params",
                               fsdp_unit_modules=("TransformerLayer",)),
}


def _muon_worker(configs):
    import torch.distributed as dist
    from cuda_testing import device

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.models import GPTConfig, GPTModel

    rank = dist.get_rank()
    out = {}
    for label, ddp_config in configs.items():
        torch.manual_seed(1234)
        model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   vocab_size=64, max_position_embeddings=8, ffn_hidden_size=64)).to(device())
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(**ddp_config))
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="muon", lr=2e-2, weight_decay=0.1, clip_grad=0.0, muon_coefficient_type="simple",
            muon_scale_mode="shape_scaling", use_distributed_optimizer=ddp_config["use_distributed_optimizer"]), [ddp])
        for step in range(3):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, 64, (2, 9), generator=gen).to(device())
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(tokens[:, :-1], tokens[:, 1:]).mean().backward()
            ddp.finish_grad_sync()
            assert opt.step()[0]
        ddp.finish_param_sync()
        with ddp.full_parameters():
            out[label] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("backend, world", FLAVOURS)
def test_muon_sharded_agrees_with_no_shard_on_cuda(backend, world):
    """Three Muon steps of a tiny GPT at ZeRO-1 and ZeRO-3 (overlapped) against no_shard, on CUDA. Would catch
    the all-to-all of the exchange failing on device tensors (gloo), pieces landing elsewhere on the device, or
    results read before the exchange completed."""
    for out in run_on_cuda(_muon_worker, world, CONFIGS, backend=backend):
        for label in ("optim", "optim_grads_params"):
            for name, value in out["no_shard"].items():
                torch.testing.assert_close(out[label][name], value, rtol=0, atol=5e-4,
                                           msg=lambda m: f"{label} {name}: {m}")
