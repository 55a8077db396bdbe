"""Unused parameters, NaN/Inf gradients and protocol misuse: clear errors on every rank, never a hang."""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed


class WithUnused(nn.Module):
    """`spare` is registered but only used when `use_spare` is set."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.use_spare = False

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.use_spare:
            h = h + self.spare(h)
        return self.out(h)


def _unused_worker(overlap, find_unused, spare_used_on_rank0, iterations=2):
    import copy

    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = WithUnused()
    reference = copy.deepcopy(model)
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=10 if overlap else None, find_unused_parameters=find_unused
    )
    ddp = DistributedDataParallel(model, config)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(dp)]
    uses = [spare_used_on_rank0 and r == 0 for r in range(dp)]
    result = {}
    for iteration in range(iterations):
        ddp.zero_grad_buffer()
        model.use_spare = uses[rank]
        ddp(xs[rank]).pow(2).mean().backward()
        try:
            ddp.finish_grad_sync()
        except ValueError as e:
            result["error"] = str(e)
            return result
    expected = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for r in range(dp):
        reference.zero_grad()
        reference.use_spare = uses[r]
        reference(xs[r]).pow(2).mean().backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[n] += p.grad / dp
    result["exact"] = all(torch.equal(p.main_grad, expected[n]) for n, p in model.named_parameters())
    return result


def test_unused_parameter_with_overlap_is_a_clear_error_on_every_rank():
    """Would catch a hang or a cryptic assert when a registered parameter gets no gradient."""
    for result in run_distributed(_unused_worker, 2, True, False, False):
        msg = result["error"]
        assert "spare.weight" in msg and "spare.bias" in msg and "find_unused_parameters=True" in msg
        assert "fc.weight" not in msg


def test_parameter_unused_on_one_rank_only_errors_there_without_hanging_the_other():
    """Would catch the rank that saw every gradient hanging in a collective its peer never joined."""
    used_rank, unused_rank = run_distributed(_unused_worker, 2, True, False, True, 1)
    assert used_rank == {"exact": True}
    assert "spare.weight" in unused_rank["error"]


def test_find_unused_parameters_gives_the_exact_mean():
    """Unused everywhere, and used on rank 0 only (its mean gradient must be halved, not dropped)."""
    for spare_used_on_rank0 in (False, True):
        results = run_distributed(_unused_worker, 2, True, True, spare_used_on_rank0)
        assert all(r == {"exact": True} for r in results), results


def test_unused_parameter_without_overlap_is_exact():
    """Without overlap everything is reduced in finish_grad_sync: unused grads are simply zero."""
    results = run_distributed(_unused_worker, 2, False, False, True)
    assert all(r == {"exact": True} for r in results), results


class _Chunk(nn.Module):
    """A model chunk whose `side` runs only when asked (a rank-dependent branch)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, use_side):
        h = torch.tanh(self.a(x))
        return self.b(h + self.side(x) if use_side else h)


class _Chunks(nn.ModuleList):
    """The chunks as one model, for torch DDP."""

    def forward(self, x, uses):
        for chunk, use in zip(self, uses):
            x = chunk(x, use)
        return x


def _chunks_set_up(strategy):
    """(rank, a gloo group with a 15 s timeout: a hang fails fast, _Chunks, torch DDP over a copy of them, the
    wrappers' config: overlap_grad_reduce and find_unused_parameters under `strategy`)."""
    import copy
    import datetime

    import torch.distributed as dist

    from megatron_lite import DistributedDataParallelConfig

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=15))
    torch.manual_seed(0)
    chunks = _Chunks([_Chunk(), _Chunk()])
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(chunks), process_group=group,
                                                    find_unused_parameters=True)
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=strategy != "no_shard",
        overlap_grad_reduce=True, find_unused_parameters=True, bucket_size=30,
        fsdp_unit_modules=("Linear",) if strategy == "optim_grads_params" else None)
    return dist.get_rank(), group, chunks, reference, config


def _chunks_worker(strategy, side_chunk):
    """Two chunks, each its own wrapper on one data-parallel group (a process-group timeout of 15 s: a hang
    fails fast), `side` of chunk `side_chunk` run by rank 1 only, with torch DDP + AdamW beside them."""
    from megatron_lite import DistributedDataParallel, OptimizerConfig, get_megatron_optimizer

    rank, group, chunks, reference, config = _chunks_set_up(strategy)
    ddps = [DistributedDataParallel(chunk, config, data_parallel_group=group) for chunk in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                 use_distributed_optimizer=strategy != "no_shard"), ddps)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)

    uses = [rank == 1 or i != side_chunk for i in range(2)]

    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for ddp in ddps:
            ddp.zero_grad_buffer()
        ddps[1](ddps[0](x, uses[0]), uses[1]).square().mean().backward()
        for ddp in ddps:
            ddp.finish_grad_sync()
        opt.step()
        torch_opt.zero_grad()
        reference(x, uses).square().mean().backward()
        torch_opt.step()
    ours = {f"{i}.{n}": v for i, ddp in enumerate(ddps) for n, v in ddp.state_dict().items()}
    theirs = reference.module.state_dict()
    return sorted(n for n in theirs if not torch.equal(ours[n], theirs[n]))


@pytest.mark.parametrize("side_chunk", [0, 1])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_chunks_with_a_parameter_some_ranks_use_match_torch(strategy, side_chunk):
    """Two model chunks (two wrappers on one group) with overlap_grad_reduce and find_unused_parameters, a
    parameter used on rank 1 only: would catch a bucket launched in backward where its parameters all got a
    gradient, i.e. on some ranks only (rank 0 then issued the other chunk's collectives first and both ranks
    waited forever; any optimizer). Parameters after three AdamW steps equal torch DDP's bit for bit."""
    for differ in run_distributed(_chunks_worker, 2, strategy, side_chunk, timeout=120):
        assert differ == []


def _one_wrapper_worker(strategy):
    """_Chunks as one wrapper with overlap_grad_reduce and find_unused_parameters, the later chunk's `side` run
    by rank 1 only: how many buckets each iteration launched before finish_grad_sync, while the wrapper is the
    only one in the process, after a second one was built and discarded, and beside a live second one; the
    parameters against torch DDP's. (`side` of the earlier chunk, so that buckets before its own complete in
    backward on rank 0 too: the later chunk's is launched first.)"""
    import copy

    from megatron_lite import DistributedDataParallel, OptimizerConfig, get_megatron_optimizer
    from megatron_lite.distributed import Bucket

    rank, group, chunks, reference, config = _chunks_set_up(strategy)
    ddp = DistributedDataParallel(chunks, config, data_parallel_group=group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                 use_distributed_optimizer=strategy != "no_shard"), [ddp])
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    uses = [rank == 1, True]
    launches = []
    original = Bucket.start_grad_sync

    def counted(bucket, *args):
        launches.append(bucket)
        return original(bucket, *args)

    Bucket.start_grad_sync = counted
    in_backward = []
    try:
        for step in range(6):
            if step == 3:  # a second wrapper, discarded at once (its hooks keep it alive until removed)
                DistributedDataParallel(copy.deepcopy(chunks), config, data_parallel_group=group).remove_grad_hooks()
            if step == 4:  # a second one alive (another model chunk)
                other = DistributedDataParallel(copy.deepcopy(chunks), config, data_parallel_group=group)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            ddp.zero_grad_buffer()
            launches.clear()
            ddp(x, uses).square().mean().backward()
            in_backward.append(len(launches))
            ddp.finish_grad_sync()
            opt.step()
            torch_opt.zero_grad()
            reference(x, uses).square().mean().backward()
            torch_opt.step()
    finally:
        Bucket.start_grad_sync = original
    del other
    theirs = reference.module.state_dict()
    differ = sorted(n for n, v in ddp.state_dict().items() if not torch.equal(v, theirs[n]))
    return dict(in_backward=in_backward, buckets=sum(len(b.buckets) for b in ddp.param_and_grad_buffers),
                differ=differ)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_one_wrapper_with_a_parameter_some_ranks_use_overlaps(strategy):
    """One wrapper with overlap_grad_reduce and find_unused_parameters, a parameter used on rank 1 only: buckets
    are launched during backward (from the second iteration on, once the gradient counts are learned), also
    after a second wrapper was built and discarded (remove_grad_hooks); beside a live second wrapper (model
    chunks) none is (see test_chunks_with_a_parameter_some_ranks_use_match_torch). Would catch
    find_unused_parameters deferring every launch to finish_grad_sync for a lone wrapper, or a discarded
    wrapper still counting. Parameters after six AdamW steps equal torch DDP's bit for bit."""
    for result in run_distributed(_one_wrapper_worker, 2, strategy, timeout=120):
        assert result["buckets"] >= 3
        assert all(n > 0 for n in result["in_backward"][1:4]), result
        assert result["in_backward"][4:] == [0, 0], result
        assert result["differ"] == []


def _nan_worker(overlap):
    import torch.distributed as dist
    from ddp_testing import loss_fn, make_batches, make_model

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    model = make_model()
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=50)
    ddp = DistributedDataParallel(model, config)
    x, y = make_batches(dist.get_world_size(), 1)[rank][0]
    messages = []
    for poison in (False, True):
        ddp.zero_grad_buffer()
        if poison and rank == 1:
            with torch.no_grad():
                model.fc1.bias[0] = float("nan")  # NaN reaches fc1's grads (and everything below it)
        loss_fn(ddp, x, y).backward()
        try:
            ddp.finish_grad_sync()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def test_nan_in_one_rank_raises_on_all_ranks_naming_rank_bucket_param():
    """Would catch a silent NaN, or a check that raises on one rank only and leaves the other hanging."""
    for overlap in (False, True):
        (clean0, msg0), (clean1, msg1) = run_distributed(_nan_worker, 2, overlap)
        assert clean0 is None and clean1 is None
        assert msg0 is not None and "rank(s) [1]" in msg0 and "rank 0's local gradients were finite" in msg0
        assert "rank 1 found NaN/Inf" in msg1 and "fc1.bias" in msg1 and "bucket" in msg1


def _misuse_worker():
    from ddp_testing import loss_fn, make_batches, make_model

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(make_model(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=50))
    x, y = make_batches(1, 1)[0][0]
    errors = []
    # 1. The last micro-batch also ran under no_sync().
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        loss_fn(ddp, x, y).backward()
    try:
        ddp.finish_grad_sync()
    except ValueError as e:
        errors.append(str(e))
    # 2. A second backward after finish_grad_sync() without zero_grad_buffer().
    ddp.zero_grad_buffer()
    loss_fn(ddp, x, y).backward()
    ddp.finish_grad_sync()
    try:
        loss_fn(ddp, x, y).backward()
    except RuntimeError as e:
        errors.append(str(e))
    # 3. Two backward passes in the last micro-batch (the bucket was already launched).
    ddp.zero_grad_buffer()
    loss_fn(ddp, x, y).backward()
    try:
        loss_fn(ddp, x, y).backward()
    except RuntimeError as e:
        errors.append(str(e))
    ddp.finish_grad_sync()  # everything was launched once: completes cleanly
    return errors


def test_protocol_misuse_messages():
    for errors in run_distributed(_misuse_worker, 2):
        assert len(errors) == 3
        assert "outside no_sync()" in errors[0]
        assert "zero_grad_buffer()" in errors[1]
        assert "second gradient" in errors[2]


def _step_without_finish_worker():
    from ddp_testing import loss_fn, make_batches
    from optim_testing import build

    _, ddp, opt = build(dict(overlap_grad_reduce=True, bucket_size=50), dict(lr=1e-3))
    x, y = make_batches(2, 1)[ddp.data_parallel_rank][0]
    ddp.zero_grad_buffer()
    loss_fn(ddp, x, y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        error = str(e)
    ddp.finish_grad_sync()  # the protocol, completed: step() now works
    ok, _, _ = opt.step()
    return error, ok


def test_step_without_finish_grad_sync_is_an_error_on_every_rank():
    """Would catch optimizer.step() on local, unreduced gradients: replicas diverge and the run exits 0."""
    for error, ok in run_distributed(_step_without_finish_worker, 2):
        assert "finish_grad_sync()" in error and ok


def _requires_grad_worker(freeze, when):
    from ddp_testing import loss_fn, make_batches, make_model

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    model = make_model()
    if not freeze:
        model.fc2.weight.requires_grad_(False)  # frozen at wrap time, unfrozen later
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
    x, y = make_batches(2, 1)[ddp.data_parallel_rank][0]
    try:
        if when == "between iterations":
            model.fc2.weight.requires_grad_(not freeze)
        ddp.zero_grad_buffer()
        if when == "during the iteration":
            model.fc2.weight.requires_grad_(not freeze)
        loss_fn(ddp, x, y).backward()
        ddp.finish_grad_sync()
    except ValueError as e:
        return str(e)
    return None


def test_changing_requires_grad_after_wrapping_names_the_parameter():
    """Would catch a 'frozen' weight that still changes (weight decay on a zero main_grad) or an unfrozen
    one that never does (it has no main_grad), both silent today."""
    for freeze in (True, False):
        for when in ("between iterations", "during the iteration"):
            for message in run_distributed(_requires_grad_worker, 2, freeze, when):
                assert message is not None and "fc2.weight" in message, (freeze, when, message)
                assert ("frozen" if freeze else "unfrozen") in message and "before wrapping" in message


def _mismatch_worker(kind):
    import torch.distributed as dist
    from ddp_testing import SmallNet

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SmallNet(width=16 if kind != "shape" or rank == 0 else 12)
    config = dict(overlap_grad_reduce=True, bucket_size=100)
    if kind == "dtype" and rank == 1:
        model.head.to(torch.float64)
    if kind == "name" and rank == 1:
        model.add_module("extra", torch.nn.Linear(2, 2))
    if kind == "config" and rank == 1:
        config["bucket_size"] = 200
    if kind == "order" and rank == 1:  # same parameters, registered in another order
        model._modules = dict(reversed(list(model._modules.items())))
    try:
        DistributedDataParallel(model, DistributedDataParallelConfig(**config))
    except ValueError as e:
        return str(e)
    return None


def test_models_or_configs_that_differ_across_ranks_are_rejected_at_wrap_time():
    """Would catch buckets of different layouts being reduced together (silent divergence) or a backend
    size-mismatch abort: every rank gets an error naming the first difference and the rank."""
    expected = {"shape": "fc1.weight: shape (12, 8)", "dtype": "torch.float64", "name": "extra.weight",
                "config": "bucket_size = 200", "order": "head.weight"}
    for kind, needle in expected.items():
        for message in run_distributed(_mismatch_worker, 2, kind):
            assert message is not None and "rank 1:" in message and needle in message, (kind, message)


class SharedCheckpointed(nn.Module):
    """One Linear used in two reentrant-checkpointed segments: its gradient arrives twice per backward."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        def segment(h):
            return torch.tanh(self.shared(h))

        h = checkpoint(segment, x, use_reentrant=True)
        h = checkpoint(segment, h, use_reentrant=True)
        return self.head(h)


def _shared_checkpoint_worker():
    import copy

    import torch.distributed as dist
    from ddp_testing import mean_of_rank_grads

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SharedCheckpointed()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1))
    exact = []
    for iteration in range(3):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * iteration + r)).requires_grad_()
              for r in range(dp)]
        ddp.zero_grad_buffer()
        ddp(xs[rank]).pow(2).mean().backward()
        ddp.finish_grad_sync()
        expected = mean_of_rank_grads(reference, xs)
        exact.append(all(torch.allclose(p.main_grad, expected[n], rtol=1e-6, atol=1e-7)
                         for n, p in model.named_parameters()))
    return exact, ddp.param_to_bucket[model.shared.weight].expected_counts


def test_gradient_arriving_twice_per_backward_under_overlap():
    """Reentrant checkpointing of a shared weight: would catch the 'second gradient' crash under
    overlap_grad_reduce, or a bucket launched after the first of the two arrivals (half a gradient)."""
    for exact, counts in run_distributed(_shared_checkpoint_worker, 2):
        assert exact == [True, True, True] and counts == [2]


class _FusedWgradLinear(torch.autograd.Function):
    """Like megatron-core's fused layers: adds the weight gradient into main_grad itself, marks
    grad_added_to_main_grad and returns a dummy gradient (so the grad hook still fires; megatron-core's is
    torch.empty, i.e. garbage, stood in for here by a large constant)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad_out.t() @ x)
        weight.grad_added_to_main_grad = True
        return grad_out @ weight, torch.full_like(weight, 1e6)


def _fused_wgrad_worker():
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(3, 5))
    module = nn.Module()
    module.weight = weight
    ddp = DistributedDataParallel(module, DistributedDataParallelConfig(overlap_grad_reduce=True))
    xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    results = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        _FusedWgradLinear.apply(xs[rank], weight).sum().backward()
        ddp.finish_grad_sync()
        expected = sum(torch.ones(4, 3).t() @ x for x in xs) / 2
        results.append(torch.allclose(weight.main_grad, expected))
    return results


def test_grad_added_to_main_grad_is_honoured():
    """Would catch the hook adding a fused layer's (dummy) gradient on top of what it already accumulated."""
    for results in run_distributed(_fused_wgrad_worker, 2):
        assert results == [True, True]
