"""ZeRO-3's full-size storages are bounded from the first iteration on: at no point of any iteration, the first
included, do more gathered parameters and full-size gradients exist than the prefetch window allows (a few units),
counted from the buckets' storages at every hook of forward and backward."""

import torch
import torch.nn as nn
from distributed_helper import run_distributed

UNITS, WIDTH = 8, 32


class Blocks(nn.Module):
    """An embedding-like input layer (root unit), UNITS residual MLP blocks (one unit each), a head (root)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(UNITS))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _peaks_worker(micro_batches):
    """Per iteration, the largest bytes of full-size gradients plus gathered parameters alive at any hook; and
    the bytes of one unit's full parameters and the root's (all fp32)."""
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    torch.manual_seed(0)
    model = Blocks()
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, bucket_size=10 ** 6))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    buckets = [b for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]
    peak = [0]

    def record(*_):
        alive = sum(b.grad_data.untyped_storage().nbytes() + b.param_data.untyped_storage().nbytes()
                    for b in buckets)
        peak[0] = max(peak[0], alive)

    for p in ddp.param_to_name:
        p.register_post_accumulate_grad_hook(record)
    for block in model.blocks:
        block.register_forward_pre_hook(record)
        block.register_forward_hook(record)
    unit_bytes = buckets[0].param_data.untyped_storage().nbytes()  # after a gather: measured below
    gen = torch.Generator().manual_seed(dist.get_rank())
    peaks = []
    for _ in range(3):
        peak[0] = 0
        ddp.zero_grad_buffer()
        for m in range(micro_batches):
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
            with ddp.no_sync() if m < micro_batches - 1 else torch.enable_grad():
                ((ddp(x) - y) ** 2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
        peaks.append(peak[0])
    with ddp.full_parameters():
        unit_bytes = max(sum(b.param_data.untyped_storage().nbytes() for b in ddp.param_sync.buckets[i])
                         for i in range(UNITS))
        root_bytes = sum(b.param_data.untyped_storage().nbytes() for b in ddp.param_sync.root)
    return peaks, unit_bytes, root_bytes


def test_first_iteration_is_bounded_like_the_steady_state():
    """Would catch the first iteration keeping every unit gathered (and every bucket's full-size gradients) from
    its backward until finish_grad_sync, i.e. the whole model in memory once per run, before the expected
    gradient counts are learned; and a steady state above the window: the root (parameters and gradients), the
    unit computing and the one prefetched (parameters and gradients: 2 x 2 units) and the reduce-scatters in
    flight (ZERO2_BUCKETS_IN_FLIGHT units of gradients). With gradient accumulation (no_sync micro-batches) the
    unreduced full-size gradients of every unit stay until the last micro-batch reduces them, in every
    iteration alike: there only the first iteration's bound is checked."""
    from megatron_lite.distributed.grad_sync import ZERO2_BUCKETS_IN_FLIGHT

    for peaks, unit, root in run_distributed(_peaks_worker, 2, 1):
        bound = 2 * root + (4 + ZERO2_BUCKETS_IN_FLIGHT) * unit
        whole_model = 2 * (root + UNITS * unit)
        assert max(peaks) <= bound < whole_model / 2, (peaks, bound, whole_model)
    for peaks, unit, root in run_distributed(_peaks_worker, 2, 2):
        assert peaks[0] <= max(peaks[1:]) < 2 * (root + UNITS * unit), peaks


def _blocks_with_distributed_optimizer(strategy, **optimizer_fields):
    """Blocks() wrapped with overlap under `strategy`, its distributed optimizer and its buckets."""
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Blocks(), DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=10 ** 6))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, **optimizer_fields), [ddp])
    return ddp, opt, [b for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]


def _grad_shard_bytes_worker(strategy):
    """Bytes of the buckets' reduced-gradient shards (grad_shard) alive after the build, after the first
    backward's finish_grad_sync, after the step, and after the next zero_grad_buffer(); and the bytes of this
    rank's parameter shards."""
    ddp, opt, buckets = _blocks_with_distributed_optimizer(strategy)

    def held():
        return sum(b.grad_shard.untyped_storage().nbytes() for b in buckets)

    sizes = {"built": held()}
    ddp.zero_grad_buffer()
    sizes["zeroed"] = held()
    ddp(torch.randn(4, 8)).sum().backward()
    ddp.finish_grad_sync()
    sizes["reduced"] = held()
    opt.step()
    sizes["stepped"] = held()
    ddp.zero_grad_buffer()
    sizes["next iteration"] = held()
    return sizes, sum(b.shard_size * b.grad_data.element_size() for b in buckets)


def test_build_holds_no_gradient_shard_before_the_first_backward():
    """Would catch ZeRO-2/3's reduced-gradient shards allocated at wrap time (or kept from one iteration's step
    to the next one's backward): 4/d bytes per parameter held through the build, the forward and its
    activations, where FSDP2 holds none (its sharded .grad exists from the backward to zero_grad)."""
    for strategy in ("optim_grads_params", "optim_grads"):
        for sizes, shard_bytes in run_distributed(_grad_shard_bytes_worker, 2, strategy):
            assert shard_bytes > 0
            assert sizes == {"built": 0, "zeroed": 0, "reduced": shard_bytes, "stepped": shard_bytes,
                             "next iteration": 0}, (strategy, sizes, shard_bytes)


def _step_without_backward_worker(strategy):
    """A step with no backward after an iteration whose reduced shards were filled with NaN (what the released
    storage may hold when it is grown again): its gradient norm and the parameters it leaves."""
    ddp, opt, buckets = _blocks_with_distributed_optimizer(strategy, weight_decay=0.0, clip_grad=1.0,
                                                           log_grad_norm=True)
    ddp.zero_grad_buffer()
    ddp(torch.randn(4, 8)).sum().backward()
    ddp.finish_grad_sync()
    for bucket in buckets:
        bucket.reduced_grad_shard.fill_(float("nan"))
    ddp.zero_grad_buffer()  # frees the shards; the step below reads them before any reduction grows them
    before = {k: v.clone() for k, v in ddp.state_dict().items()}
    ok, norm, _ = opt.step()
    after = ddp.state_dict()
    return ok, norm, all(torch.equal(before[k], after[k]) for k in before)


def test_a_step_before_any_backward_reads_zero_gradient_shards():
    """Would catch a gradient shard grown back without zeroing (ZeRO-2/3's shards are freed by zero_grad_buffer
    and grown by whatever reads them first): a step with no backward since then (every parameter frozen for an
    iteration, a schedule that steps without data) must see zeros, as ZeRO-1's zeroed buffer, not what the
    storage held before."""
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for ok, norm, unchanged in run_distributed(_step_without_backward_worker, 2, strategy):
            assert (ok, norm, unchanged) == (True, 0.0, True), (strategy, ok, norm, unchanged)
