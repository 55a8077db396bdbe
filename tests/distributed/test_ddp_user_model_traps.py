"""DistributedDataParallel on models and habits nobody here wrote: torch idioms that used to be silently
wrong (dtype conversion after wrapping, reading sharded parameters through the inner module, buffers that
drift apart, a shadowed nn.Module method) and the megatron-core calls a megatron-core training loop makes."""

import copy

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed
from optim_testing import HEADS, TwoHeads, heads_side_by_side

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _wrap(model, strategy, **kwargs):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    zero3 = strategy == "optim_grads_params"
    kwargs = {"overlap_grad_reduce": zero3, "fsdp_unit_modules": ("Linear",) if zero3 else None, **kwargs}
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **kwargs)
    return DistributedDataParallel(model, config)


def _optimizer(ddp, strategy, **kwargs):
    from megatron_lite import OptimizerConfig, get_megatron_optimizer

    bf16 = next(iter(ddp.param_to_name)).dtype == torch.bfloat16
    return get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=strategy != "no_shard", bf16=bf16,
                                                  **{"lr": 1e-2, **kwargs}), ddp)


def _step(ddp, opt, x):
    ddp.zero_grad_buffer()
    ddp(x).float().square().mean().backward()
    ddp.finish_grad_sync()
    return opt.step()


# ------------------------------------------------------------------------------ parameters changed after wrapping
def _moved_worker(strategy, how):
    from ddp_testing import make_model

    ddp = _wrap(make_model(), strategy)
    opt = _optimizer(ddp, strategy)
    if how == "bf16":
        ddp.module.to(torch.bfloat16)
    elif how == "half":
        ddp.module.half()
    else:
        with torch.no_grad():
            ddp.module.fc1.weight.data = ddp.module.fc1.weight.data.clone()
    try:
        _step(ddp, opt, torch.randn(4, 8, dtype=next(ddp.module.parameters()).dtype))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_converted_after_wrapping_are_an_error(strategy):
    """Would catch `model.to(torch.bfloat16)` / `.half()` / `param.data = ...` after wrapping: with the
    distributed optimizer the step wrote into a buffer the model no longer used (weights never changed, no
    error); under no_shard it trained bf16 weights through an fp32 buffer layout."""
    for how in ("bf16", "half", "assign"):
        if how == "assign" and strategy == "no_shard":
            continue  # no_shard keeps the parameter's own storage: assigning data is legal there
        for error in run_distributed(_moved_worker, 2, strategy, how):
            assert error is not None and "parameters changed under DistributedDataParallel" in error, (how, error)
            assert "fc1.weight" in error and "before wrapping" in error


class GrowingTable(nn.Module):
    """A frozen position table re-created as a new Parameter when a longer input comes (as transformers' older
    sinusoidal position embeddings did): the same values for the same positions, a new object."""

    def __init__(self, length):
        super().__init__()
        self.make(length)

    def make(self, length):
        table = torch.sin(torch.arange(length * 8, dtype=torch.float32).reshape(length, 8) / 7)
        self.weights = nn.Parameter(table, requires_grad=False)

    def forward(self, x):
        if x.shape[1] > self.weights.shape[0]:
            self.make(x.shape[1])
        return x + self.weights[: x.shape[1]]


def _frozen_replaced_worker(strategy):
    outcomes = {}
    for initial in (6, 2):  # 6: never replaced (the reference); 2: replaced by the second step, kept below
        torch.manual_seed(0)
        ddp = _wrap(nn.Sequential(GrowingTable(initial), nn.Linear(8, 8)), strategy)
        opt = _optimizer(ddp, strategy)
        gen = torch.Generator().manual_seed(1)
        try:
            for length in (2, 6, 6):
                _step(ddp, opt, torch.randn(4, length, 8, generator=gen))
            outcomes[initial] = [v.clone() for v in ddp.state_dict().values()]  # ZeRO-3: gathered
        except ValueError as e:
            outcomes[initial] = str(e)
    replaced, reference = outcomes[2], outcomes[6]
    if isinstance(replaced, str):
        return replaced, None
    trained_alike = all(torch.equal(a, b) for a, b in zip(replaced, reference))
    ddp.module[0].weights.requires_grad_(True)  # the replacement made trainable: in no buffer, an error
    try:
        _step(ddp, opt, torch.randn(4, 6, 8))
        unfrozen = "no error"
    except ValueError as e:
        unfrozen = str(e)
    return trained_alike, unfrozen


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_frozen_parameter_replaced_after_wrapping_trains(strategy):
    """Would catch the check for modules replaced after wrapping refusing a frozen Parameter re-created in the
    forward (a position table grown for a longer input; in no buffer or optimizer either way, fine under torch
    DDP) as 'new ... never reduced nor trained, gone ... still stepped', or letting such a new parameter be
    made trainable later without an error."""
    for trained_alike, unfrozen in run_distributed(_frozen_replaced_worker, 2, strategy):
        assert trained_alike is True, trained_alike
        assert "0.weights" in unfrozen and "since the model was wrapped" in unfrozen, unfrozen


def test_parameters_replaced_by_load_state_dict_assign_name_the_remedy():
    """Would catch `load_state_dict(..., assign=True)` after wrapping (new Parameter objects, in no buffer)
    refused with advice about modules only, instead of also saying to load the weights in place."""
    from megatron_lite.distributed.grad_checks import raise_if_params_replaced

    model = nn.Linear(2, 2)
    wrapped = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"gone \['weight', 'bias'\].*without assign=True"):
        raise_if_params_replaced(model, wrapped)


# ------------------------------------------------------------------------------ ZeRO-3 state_dict of the inner module
def _inner_state_dict_worker():
    from ddp_testing import make_model

    model = make_model()
    expected = copy.deepcopy(model.state_dict())
    ddp = _wrap(model, "optim_grads_params")
    outcomes = {}
    try:
        ddp.module.state_dict()
        outcomes["bare"] = "no error"
    except RuntimeError as e:
        outcomes["bare"] = str(e)
    with ddp.full_parameters():
        inside = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    outcomes["inside"] = all(torch.equal(inside[k], v) for k, v in expected.items())
    outcomes["wrapper"] = all(torch.equal(ddp.state_dict()[k], v) for k, v in expected.items())
    return outcomes


def test_zero3_inner_module_state_dict_refuses_placeholders():
    """Would catch `model.module.state_dict()` (Hugging Face's save_pretrained(model.module)) silently
    returning the NaN placeholders of released ZeRO-3 parameters instead of raising with the remedy."""
    for out in run_distributed(_inner_state_dict_worker, 2):
        assert "full_parameters()" in out["bare"] and "wrapper's state_dict()" in out["bare"], out["bare"]
        assert out["inside"] and out["wrapper"]


# ------------------------------------------------------------------------------ buffers (BatchNorm statistics)
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


def _buffers_worker(strategy, broadcast):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = BNNet()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=broadcast)
    ddp = _wrap(model, strategy, broadcast_buffers=broadcast)
    opt = _optimizer(ddp, strategy, weight_decay=0.0, clip_grad=0.0)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(6, 8, generator=gen) * (1 + rank)
        _step(ddp, opt, x)
        torch_opt.zero_grad()
        reference(x).square().mean().backward()
        torch_opt.step()
    with torch.no_grad():  # an eval forward: the first one after training broadcasts once more, as in torch
        ddp.eval(), reference.eval()
        ddp(torch.randn(2, 8)), reference(torch.randn(2, 8))
    ours = {k: v.clone() for k, v in ddp.state_dict().items()}
    theirs = reference.module.state_dict()
    return {k: torch.equal(ours[k], theirs[k]) for k in theirs}, ours["bn.running_mean"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_buffers_follow_torch_ddp_broadcast_buffers(strategy):
    """Would catch BatchNorm running statistics that drift apart across ranks (torch DDP copies rank 0's
    buffers before each forward by default), and broadcast_buffers=False not keeping each rank's own."""
    for broadcast in (True, False):
        results = run_distributed(_buffers_worker, 2, strategy, broadcast)
        for same, _ in results:
            assert all(same.values()), (broadcast, same)
        agree = torch.equal(results[0][1], results[1][1])
        assert agree == broadcast  # with the broadcast every rank holds rank 0's statistics


# ------------------------------------------------------------------------------ nn.Module surface
def _surface_worker():
    from ddp_testing import make_model

    ddp = _wrap(BNNet(), "optim")
    shadowed = [name for name, value in vars(ddp).items()
                if not name.startswith("__") and callable(getattr(nn.Module, name, None))]
    return shadowed, len(list(ddp.buffers())), len(list(ddp.named_buffers())), make_model is not None


def test_no_wrapper_attribute_shadows_an_nn_module_method():
    """Would catch an instance attribute named like an nn.Module method (`self.buffers` made
    `model.buffers()` raise "'list' object is not callable")."""
    for shadowed, buffers, named, _ in run_distributed(_surface_worker, 2):
        assert shadowed == [] and buffers == named == 3  # running_mean, running_var, num_batches_tracked


# ------------------------------------------------------------------------------ megatron-core loop calls
def _megatron_calls_worker(strategy):
    import torch.distributed as dist
    from ddp_testing import make_model

    from megatron_lite import OptimizerConfig, get_megatron_optimizer
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank = dist.get_rank()
    ddp = _wrap(make_model(), strategy)
    out = {}
    x = torch.randn(4, 8) + rank
    ddp.zero_grad_buffer()
    ddp(x).square().mean().backward()
    if strategy in ("optim_grads", "optim_grads_params"):
        try:
            ddp.finish_grad_sync(force_all_reduce=True)
        except ValueError as e:
            out["force"] = str(e)
        ddp.finish_grad_sync()
    else:
        ddp.finish_grad_sync(force_all_reduce=True)
        out["force"] = torch.cat([b.grad_data for b in ddp.param_and_grad_buffers])
    ddp.free_overlap_buffers()
    bucket = ddp.param_and_grad_buffers[0].buckets[0]
    start, end = bucket.param_to_index[bucket.params_list[-1]]
    out["index"] = end - start == bucket.params_list[-1].numel() and end <= bucket.numel_unpadded
    opt = get_megatron_optimizer(OptimizerConfig(lr=None, use_distributed_optimizer=strategy != "no_shard"), ddp)
    try:
        opt.step()
    except ValueError as e:
        out["lr_none"] = str(e)
    OptimizerParamScheduler(opt, 1e-2, 0.0, 0, 10, "constant")
    out["stepped"] = opt.step()[0]
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_core_loop_calls(strategy):
    """Would catch the megatron-core calls that raised TypeError/AttributeError: finish_grad_sync(
    force_all_reduce=True) (which must leave the whole reduced gradient on every rank), free_overlap_buffers(),
    Bucket.param_to_index, OptimizerConfig(lr=None) with the scheduler setting the lr (and a clear error
    when nothing does)."""
    results = run_distributed(_megatron_calls_worker, 2, strategy)
    for out in results:
        assert out["index"] and out["stepped"]
        assert "no learning-rate scheduler set it" in out["lr_none"]
    if strategy in ("optim_grads", "optim_grads_params"):
        assert all("force_all_reduce=True" in out["force"] for out in results)
    else:
        assert torch.equal(results[0]["force"], results[1]["force"])


def _megatron_call_shapes_worker(strategy):
    """megatron-core 0.16's call shapes of the loop calls, against the plain calls' results: start_grad_sync with
    a hook's arguments, finish_grad_sync(force_all_reduce=None), start_param_sync(*args, force_sync=...,
    force_dispatch=...), reload_model_params(state_dict=None), and fp32 local accumulation given as a list."""
    import torch.distributed as dist
    from ddp_testing import make_model

    rank = dist.get_rank()
    x = torch.randn(4, 8) + rank
    results = {}
    for shape in ("plain", "megatron-core"):
        core = shape == "megatron-core"
        ddp = _wrap(make_model(), strategy)
        opt = _optimizer(ddp, strategy)
        ddp.zero_grad_buffer()
        ddp(x).square().mean().backward()
        if core:
            ddp.start_grad_sync(None, "a hook's arguments")
            ddp.finish_grad_sync(force_all_reduce=None)
        else:
            ddp.finish_grad_sync()
        grads = [b.grad_data.clone() for b in ddp.param_and_grad_buffers if b.grad_data is not None]  # ZeRO-2/3: none
        opt.step()
        if core:
            ddp.start_param_sync(None, force_sync=True, force_dispatch=True)
            ddp.start_param_sync(force_dispatch=True)
            opt.reload_model_params(state_dict=None)
        ddp.finish_param_sync()
        with ddp.full_parameters():
            results[shape] = grads, {k: v.clone() for k, v in ddp.module.state_dict().items()}
    ddp = _wrap(make_model(dtype=torch.bfloat16), strategy, param_name_patterns_for_fp32_local_accumulation=["all"])
    dtypes = {p.main_grad.dtype for p in ddp.module.parameters()}
    return results, dtypes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_core_call_shapes(strategy):
    """Would catch a TypeError for a call megatron-core 0.16 accepts (start_grad_sync(*hook_args),
    start_param_sync(..., force_dispatch=True), reload_model_params(state_dict=None), the fp32 local accumulation
    patterns as a list), or finish_grad_sync(force_all_reduce=None) meaning anything but the default."""
    for results, dtypes in run_distributed(_megatron_call_shapes_worker, 2, strategy):
        (plain_grads, plain_weights), (core_grads, core_weights) = results["plain"], results["megatron-core"]
        assert len(plain_grads) == len(core_grads) and all(map(torch.equal, plain_grads, core_grads))
        assert all(torch.equal(plain_weights[k], core_weights[k]) for k in plain_weights)
        assert dtypes == {torch.float32}


def test_num_buckets_sets_the_bucket_size():
    """Would catch DistributedDataParallelConfig.num_buckets (--ddp-num-buckets) missing or combined with
    bucket_size silently."""
    from megatron_lite import DistributedDataParallelConfig

    with pytest.raises(ValueError, match="set only one"):
        DistributedDataParallelConfig(bucket_size=10, num_buckets=2)
    with pytest.raises(ValueError, match="num_buckets"):
        DistributedDataParallelConfig(num_buckets=0)
    assert run_distributed(_num_buckets_worker, 2) == [4, 4]


def _num_buckets_worker():
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    model = nn.Sequential(*[nn.Linear(10, 10, bias=False) for _ in range(8)])
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, num_buckets=4))
    return len(ddp.param_and_grad_buffers[0].buckets)


# ------------------------------------------------------------------------------ .grad after the sync
def _grad_alias_worker(strategy):
    import torch.distributed as dist
    from ddp_testing import make_model

    ddp = _wrap(make_model(), strategy, gradient_as_bucket_view=True)
    opt = _optimizer(ddp, strategy, clip_grad=1e9, log_grad_norm=True)
    ddp.zero_grad_buffer()
    ddp(torch.randn(4, 8) + dist.get_rank()).square().mean().backward()
    ddp.finish_grad_sync()
    grads = [p.grad for p in ddp.parameters()]
    torch_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e9).item()
    _, norm, _ = opt.step()
    return all(g is None for g in grads), torch_norm, norm


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_grad_after_sync_is_whole_or_none(strategy):
    """Would catch .grad left aliasing a half-reduced buffer under the distributed optimizer (torch's
    clip_grad_norm_ would then read other ranks' unreduced shards on NCCL), and under no_shard a .grad that
    torch's clip_grad_norm_ cannot use (its norm must equal the optimizer's)."""
    for none, torch_norm, norm in run_distributed(_grad_alias_worker, 2, strategy):
        if strategy == "no_shard":
            assert not none and torch_norm == pytest.approx(norm, rel=1e-6)
        else:
            assert none and torch_norm == 0.0


# ------------------------------------------------------------------------------ parameters no rank used
def _unused_worker(strategy, resume, heads):
    """Steps that leave a head unused on every rank (torch skips it: no moments, no weight decay, its own
    step count lags), then a checkpoint round trip into a fresh optimizer, which must continue alike."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoHeads()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = _wrap(model, strategy, find_unused_parameters=True, overlap_grad_reduce=True, bucket_size=30)
    decay = [p for n, p in reference.named_parameters() if not n.endswith(".bias")]
    no_decay = [p for n, p in reference.named_parameters() if n.endswith(".bias")]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, foreach=True)
    diffs, _ = heads_side_by_side(ddp, lambda: _optimizer(ddp, strategy, weight_decay=0.1, clip_grad=0.0),
                                  reference, torch_opt, heads, resume, rank)
    return diffs, sorted(ddp.param_to_name[p] for p in ddp.unused_params)


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("resume", ["torch", "shards"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_no_rank_used_are_skipped_like_torch(strategy, resume, heads):
    """Would catch Adam stepping a parameter that no rank used in an iteration (moments keep moving, weight
    decay shrinks it) where torch's optimizer skips it, and a checkpoint that gives every parameter the
    optimizer's step count (a skipped parameter's bias correction lags, as torch's per-tensor step does;
    one that never stepped starts from 0 in every format)."""
    for diffs, unused in run_distributed(_unused_worker, 2, strategy, resume, heads):
        assert diffs == [0.0] * len(HEADS[heads]), diffs
        assert unused == []  # the last step used both heads
