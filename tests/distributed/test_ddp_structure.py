"""Single-process checks of the wrapper's structure: buffers, views, attribute names, config validation."""

import pytest
import torch
import torch.nn as nn

from megatron_lite import Bucket, DistributedDataParallel, DistributedDataParallelConfig, ParamAndGradBuffer
from megatron_lite.distributed.layout import compute_buffer_layout


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(8, 8).to(torch.bfloat16)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, registered once
        self.embed.weight.shared_embedding = True

    def forward(self, idx):
        h = self.frozen(self.embed(idx))
        h = self.body(h.to(torch.bfloat16)).float()
        return self.head(h)


def test_buffers_per_dtype_views_and_names(single_rank_group):
    model = Mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(use_distributed_optimizer=True))
    # One buffer per (param dtype, grad dtype), in first-seen order; frozen params excluded.
    assert [(b.param_dtype, b.grad_dtype) for b in ddp.param_and_grad_buffers] == [
        (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)
    ]
    fp32, bf16 = ddp.param_and_grad_buffers
    assert isinstance(fp32, ParamAndGradBuffer) and all(isinstance(b, Bucket) for b in fp32.buckets)
    assert set(fp32.param_index_map) == {model.embed.weight}
    assert set(bf16.param_index_map) == {model.body.weight, model.body.bias}
    assert not hasattr(model.frozen.weight, "main_grad")
    # The same layout the pure function computes; the shared embedding has its own bucket.
    layout = compute_buffer_layout([p.numel() for p in bf16.params], bucket_size=None,
                                   data_parallel_world_size=1, use_distributed_optimizer=True)
    assert [bf16.param_index_map[p] for p in bf16.params] == list(layout.param_ranges)
    assert (bf16.numel, bf16.numel_unpadded) == (layout.numel, layout.numel_unpadded)
    for buffer in ddp.param_and_grad_buffers:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            # main_grad and param.data are views into the buffers, at the recorded offsets.
            assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
            assert param.data.data_ptr() == buffer.param_data[start:].data_ptr()
            bucket = buffer.buckets[bucket_id]
            assert any(p is param for p in bucket.params_list)
            assert bucket.offset <= start and end <= bucket.offset + bucket.numel_unpadded
            assert bucket.grad_data.data_ptr() == buffer.grad_data[bucket.offset:].data_ptr()
            assert bucket.param_data.data_ptr() == buffer.param_data[bucket.offset:].data_ptr()
    # Values preserved when parameters moved into the buffer.
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
    # state_dict without a `module.` prefix, loadable into the bare model.
    assert set(ddp.state_dict()) == set(Mixed().state_dict())
    ddp.load_state_dict(Mixed().state_dict())


def test_no_param_buffer_without_distributed_optimizer(single_rank_group):
    model = nn.Linear(4, 4)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
    buffer = ddp.param_and_grad_buffers[0]
    assert buffer.param_data is None and buffer.buckets[0].param_data is None
    assert ddp.param_and_grad_buffers[0].numel == ddp.param_and_grad_buffers[0].numel_unpadded == 20


def test_bucket_size_resolution(single_rank_group):
    """Megatron: default 40M elements with overlap, one bucket (None) without overlap."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True))
    assert ddp.bucket_size == 40_000_000
    assert DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=10)).bucket_size is None
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=72))
    assert len(ddp.param_and_grad_buffers[0].buckets) == 4


def test_wrapper_runs_a_step_in_one_process(single_rank_group):
    """World size 1: main_grad equals the plain gradient, and scale_gradients scales it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=16))
    x = torch.randn(5, 4)
    ddp.zero_grad_buffer()
    ddp(x).sum().backward()
    ddp.finish_grad_sync()
    reference(x).sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.grad is None and torch.equal(p.main_grad, r.grad)
    ddp.scale_gradients(0.5)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.main_grad, r.grad * 0.5)
    ddp.broadcast_params()  # world size 1: a no-op that must not fail


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(bucket_size=0), ValueError, "bucket_size"),
        (dict(bucket_size=-5), ValueError, "bucket_size"),
        (dict(bucket_size=1.5), TypeError, "bucket_size"),
        (dict(bucket_size=True), TypeError, "bucket_size"),
        (dict(overlap_param_gather=True), ValueError, "overlap_param_gather"),
        (dict(pad_buckets_for_high_nccl_busbw=True), ValueError, "pad_buckets_for_high_nccl_busbw"),
        (dict(overlap_grad_reduce="yes"), TypeError, "overlap_grad_reduce"),
        (dict(grad_reduce_in_fp32=1), TypeError, "grad_reduce_in_fp32"),
        (dict(prefetch_bucket_size=1000), ValueError, "prefetch_bucket_size=1000 .*optim_grads_params"),
        (dict(param_persistence_threshold=10), ValueError, "param_persistence_threshold=10 .*optim_grads_params"),
        (dict(max_reuse_distance=0), ValueError, "max_reuse_distance=0 .*optim_grads_params"),
        (dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
              prefetch_bucket_size=-1), ValueError, "prefetch_bucket_size must be >= 0"),
        (dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
              param_persistence_threshold=1.5), TypeError, "param_persistence_threshold must be an int"),
        (dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
              param_persistence_threshold=None), TypeError, "param_persistence_threshold"),
    ],
)
def test_config_validation(kwargs, error, field):
    with pytest.raises(error, match=field):
        DistributedDataParallelConfig(**kwargs)


def test_config_valid_combinations():
    DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True,
                                  pad_buckets_for_high_nccl_busbw=True, bucket_size=1)
    DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                                  prefetch_bucket_size=0, param_persistence_threshold=100_000)


def test_wrapper_argument_errors(single_rank_group):
    with pytest.raises(TypeError, match="config"):
        DistributedDataParallel(nn.Linear(2, 2), {"overlap_grad_reduce": True})
    with pytest.raises(TypeError, match="module"):
        DistributedDataParallel("not a module", DistributedDataParallelConfig())


def test_grad_aliasing_main_grad_is_not_double_counted(single_rank_group):
    """FP32Optimizer sets param.grad = main_grad for its step; if that alias survives into the next
    backward, autograd accumulates into the buffer in place and the hook must not add it again."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
    x = torch.randn(4, 3)
    ddp.zero_grad_buffer()
    for p in model.parameters():
        p.grad = p.main_grad  # the alias, as left by an optimizer step
    ddp(x).sum().backward()
    expected = torch.autograd.grad(nn.functional.linear(x, model.weight, model.bias).sum(), model.weight)[0]
    assert torch.equal(model.weight.main_grad, expected)
    assert model.weight.grad.data_ptr() == model.weight.main_grad.data_ptr()  # kept for the next micro-batch


def test_remove_grad_hooks_unregisters_them_and_frees_the_gradient_side(single_rank_group):
    """Live recovery discards a wrapper after a failure with remove_grad_hooks(): would catch hooks left on the
    parameters (a backward of the kept model still adds into the old buffer, and the parameters keep the
    gradient synchronization, its buckets and process groups alive once the wrapper is dropped)."""
    import gc
    import weakref

    model = nn.Linear(3, 2)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4))
    ddp.zero_grad_buffer()
    ddp.remove_grad_hooks()
    model(torch.randn(4, 3)).sum().backward()  # the bare model: no hook runs
    assert all(torch.count_nonzero(p.main_grad) == 0 and p.grad is not None for p in model.parameters())
    grad_sync = weakref.ref(ddp.grad_sync)
    del ddp
    gc.collect()
    assert grad_sync() is None
