"""ZeRO-3 units (param_units.py): only a few units are gathered at a time and training matches ZeRO-1; on models
whose ranks do not all run the same modules, or reach units in another order, gathers stay collective-matched;
and the unit discovery rules: a unit choice that finds nothing is an error, not the whole model gathered at
once."""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags


class Branchy(nn.Module):
    """A trunk, two branch blocks of which each rank runs only one (chosen by the caller), a head."""

    def __init__(self, widths=(8, 8)):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, w), nn.Tanh(), nn.Linear(w, 8)) for w in widths)
        self.head = nn.Linear(8, 2)

    def forward(self, x, branch):
        return self.head(self.blocks[branch](torch.tanh(self.trunk(x))))


def _branch_worker(widths, strategy, steps=3, bucket_size=40, prefetch_bucket_size=None):
    """megatron_lite and torch DDP + AdamW on the same model, rank r taking the first block at even r + step and
    the last one at odd (the blocks in between, if any, run on no rank)."""
    import copy

    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy(widths)
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=bucket_size,
        find_unused_parameters=True, prefetch_bucket_size=prefetch_bucket_size))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                 use_distributed_optimizer=strategy != "no_shard"), ddp)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(steps):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
        branch = (len(widths) - 1) * ((rank + step) % 2)
        ddp.zero_grad_buffer()
        ((ddp(x, branch) - y) ** 2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
        torch_opt.zero_grad()
        ((reference(x, branch) - y) ** 2).mean().backward()
        torch_opt.step()
    with ddp.full_parameters():
        ours = {n: p.detach().clone() for n, p in model.named_parameters()}
    theirs = dict(reference.module.named_parameters())
    return {n: (ours[n] - theirs[n]).abs().max().item() for n in ours}


@pytest.mark.parametrize("prefetch", [None, 0, 10 ** 9], ids=["prefetch_default", "prefetch_0", "prefetch_all"])
@pytest.mark.parametrize("bucket_size", [40, 10_000], ids=["bucket_per_param", "bucket_per_unit"])
@pytest.mark.parametrize("widths", [(8, 8), (8, 12), (8, 8, 8, 8)],
                         ids=["equal_branches", "unequal_branches", "far_branches"])
def test_zero3_rank_dependent_branches_match_torch_ddp(widths, bucket_size, prefetch):
    """Would catch ZeRO-3 gathers that pair different units across ranks when ranks use different blocks
    (equal sizes: silently wrong parameters; unequal sizes: a gloo size mismatch), and units released in
    backward before all their gradients were computed (a unit unused in the first iteration expects 0; a
    bucket of several parameters released at its first gradient: the unit's first layer then back-propagates
    through the placeholder). Under every prefetch window (prefetch_bucket_size None, 0, everything): would
    catch a rank that issues the gathers of the branch it skipped only after waiting for the gradient
    collectives, while its peer waits for one of them in its backward (a gloo timeout: the window 0 with
    two blocks, the default window with the first and last of four)."""
    for diffs in run_distributed(_branch_worker, 2, widths, "optim_grads_params", 3, bucket_size, prefetch):
        assert max(diffs.values()) == 0.0, diffs


class Reuser(Branchy):
    """Runs its chosen block twice: ranks choosing different blocks re-gather different units."""

    def forward(self, x, branch):
        block = self.blocks[branch]
        return self.head(block(block(torch.tanh(self.trunk(x)))))


def _reuse_worker():
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Reuser(), DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, find_unused_parameters=True))
    ddp.zero_grad_buffer()
    ddp(torch.randn(4, 6), dist.get_rank()).sum().backward()
    try:
        ddp.finish_grad_sync()
    except RuntimeError as e:
        return str(e)
    return None


def test_zero3_rank_dependent_reuse_raises_on_every_rank():
    """Would catch a unit re-gathered out of the fixed order on some ranks only (rank 0 runs block 0 twice,
    rank 1 block 1 twice): the gathers pair different units across ranks, silently wrong parameters."""
    for error in run_distributed(_reuse_worker, 2):
        assert error is not None and "gathered parameters in different sequences" in error


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return x + self.bn(self.conv(x))


def _resnetish():
    return nn.Sequential(nn.Conv2d(3, 3, 1), Block(), Block(), nn.Flatten(), nn.LazyLinear(2))


def test_unit_discovery_refuses_to_gather_everything_silently():
    """Would catch fsdp_unit_modules naming a class the model lacks (a typo) or the default finding no
    nn.ModuleList (a ResNet-like nn.Sequential): both used to give 0 units, the whole model gathered at once."""
    from megatron_lite.distributed.fsdp_units import find_units

    model = _resnetish()
    with pytest.raises(ValueError, match=r"\['Blok'\].*Block: 2"):
        find_units(model, ("Blok",))
    with pytest.raises(ValueError, match=r"no nn.ModuleList.*Block: 2.*fsdp_unit_modules=\(\)"):
        find_units(model, None)
    assert find_units(model, ()) == []  # explicitly the whole model
    assert find_units(model, ("Block",)) == [model[1], model[2]]
    assert len(find_units(Branchy(), None)) == 2  # ModuleList children, as before


class _Probe(torch.autograd.Function):
    """Identity; its backward (after the next block's backward) calls `probe`."""

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe()
        return grad, None


class ProbedBlock(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index, self.probe = index, None
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if self.probe is not None:
            self.probe("forward", self.index)
        return torch.tanh(self.fc(x))


class ProbedChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(ProbedBlock(k) for k in range(4))
        self.probe = None

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(_Probe.apply(x, lambda k=block.index: self.probe("backward", k)))
        return x


def _prefetch_worker():
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    model = ProbedChain()
    blocks = model.blocks
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True))
    units = ddp.param_sync

    def dispatched(unit):
        return all(b.params_gathered or b.param_gather_handle is not None for b in units.buckets[unit])

    seen = []

    def probe(phase, k):
        nxt = k + 1 if phase == "forward" else k - 1
        if 0 <= nxt < len(blocks):
            seen.append((phase, k, dispatched(nxt)))

    model.probe = probe
    for block in blocks:
        block.probe = probe
    for _ in range(2):  # the second iteration releases units as their backward completes
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 6)).sum().backward()
        ddp.finish_grad_sync()
    return seen


def test_zero3_prefetches_the_next_unit():
    """Would catch the prefetch silently dropped (only a speed loss, no wrong number): in unit k's forward the
    gather of unit k+1 must already be in flight (or done), and after unit k's backward that of unit k-1."""
    for seen in run_distributed(_prefetch_worker, 2):
        assert {phase for phase, _, _ in seen} == {"forward", "backward"} and len(seen) == 12
        assert all(ok for _, _, ok in seen), seen


class Stack(torch.nn.Module):
    """Six Linear+tanh layers in a ModuleList (ZeRO-3's default units) between a root input and head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _train_step(ddp, opt, x):
    """One training step of the ZeRO-3 workers below: the mean square of the output as the loss."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    ddp.finish_grad_sync()
    opt.step()


def _zero3_worker():
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank = dist.get_rank()
    results = {}
    for strategy in ("optim", "optim_grads_params"):
        model = Stack()
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
        gathered = []
        if strategy == "optim_grads_params":
            units = ddp.param_sync
            root = set(map(id, units.root))

            def record(*_):
                gathered.append(sum(b.params_gathered for b in units.all_buckets() if id(b) not in root))
            for layer in model.layers:
                layer.register_forward_pre_hook(lambda m, a: record())
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(record)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 2:
                gathered.clear()  # the first iterations learn the gradient arrivals; look at the third
            _train_step(ddp, opt, x)
        ddp.finish_param_sync()
        released = None
        if strategy == "optim_grads_params":
            released = (all(not b.params_gathered for b in ddp.param_sync.all_buckets())
                        and all(torch.isnan(p).all() for p in model.parameters()))
        results[strategy] = dict(state={k: v.clone() for k, v in ddp.state_dict().items()}, released=released,
                                 max_gathered=max(gathered, default=None),
                                 units=len(ddp.param_sync.units) if ddp.shards_params else None)
    same = all(torch.equal(results["optim"]["state"][k], v) for k, v in results["optim_grads_params"]["state"].items())
    return same, results["optim_grads_params"]


def test_zero3_gathers_a_few_units_at_a_time_and_matches_zero1():
    """Would catch a unit left gathered after its forward or backward (peak memory = the whole model), a
    prefetch that gathers everything, a stale or half-written parameter (state differs from ZeRO-1's), or
    a released parameter that still holds (or silently reads as) real data."""
    for same, zero3 in run_distributed(_zero3_worker, 2):
        assert same and zero3["released"] and zero3["units"] == 6
        assert zero3["max_gathered"] <= 3, zero3["max_gathered"]  # the unit in use, the prefetched, one releasing


def _steps_inside_full_parameters_worker():
    import contextlib

    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    # Every parameter in a unit for the forward-only case: the root (the inner module's own parameters) has no
    # hook to gather it again before a backward that runs after the context ended (a limit).
    states = {}
    for where, units in [("outside", None), ("inside", None), ("inside, write_back", None),
                         ("outside", ("Linear",)), ("forward only inside", ("Linear",))]:
        ddp = DistributedDataParallel(Stack(), DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, fsdp_unit_modules=units))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-1, use_distributed_optimizer=True), [ddp])
        whole_steps = where in ("inside", "inside, write_back")
        with ddp.full_parameters(write_back="back" in where) if whole_steps else contextlib.nullcontext():
            for step in range(3):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
                if where != "forward only inside":
                    _train_step(ddp, opt, x)
                    continue
                ddp.zero_grad_buffer()
                opt.zero_grad()
                with ddp.full_parameters():
                    loss = ddp(x).pow(2).mean()
                loss.backward()  # the units were released when the context ended: gathered again for it
                ddp.finish_grad_sync()
                opt.step()
        states[where, units] = {k: v.clone() for k, v in ddp.state_dict().items()}
    return {where: all(torch.equal(v, states["outside", units][k]) for k, v in state.items())
            for (where, units), state in states.items() if where != "outside"}


def test_zero3_training_steps_inside_full_parameters():
    """Would catch the optimizer's step inside full_parameters() (where nothing is released) leaving the
    gathered parameters stale: the next forwards computing with the weights of before the step, and
    write_back at the end copying those stale weights over the steps' shards; or a forward inside it whose
    backward runs after it getting no hook to gather its units again (a storage error, as the units' own
    forward hooks do nothing inside it)."""
    for same in run_distributed(_steps_inside_full_parameters_worker, 2):
        assert same == {"inside": True, "inside, write_back": True, "forward only inside": True}, same


def _zero3_order_worker():
    import copy

    import torch.distributed as dist
    from ddp_testing import mean_of_rank_grads
    from test_ddp_overlap import TwoBranches

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoBranches()
    model.a_first = rank == 0  # forward (so backward, so the units' gathers) in a rank-dependent order
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, bucket_size=1,
        fsdp_unit_modules=("Linear",)))
    exact = []
    for iteration in range(3):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * iteration + r)) for r in range(dp)]
        ddp.zero_grad_buffer()
        ddp(xs[rank]).pow(2).mean().backward()
        ddp.finish_grad_sync()
        expected = mean_of_rank_grads(reference, xs)
        buffer = ddp.param_and_grad_buffers[0]
        flat = torch.zeros(buffer.numel)
        for p, (start, end, _) in buffer.param_index_map.items():
            flat[start:end] = expected[ddp.param_to_name[p]].reshape(-1)
        exact.append(all(torch.allclose(b.reduced_grad_shard,
                                        flat[b.offset + b.shard_offset:b.offset + b.shard_offset + b.shard_size],
                                        rtol=1e-6, atol=1e-7) for b in buffer.buckets))
    return exact


def test_zero3_units_reached_in_a_rank_dependent_order():
    """Each rank's forward visits the two units in another order: would catch gathers issued in the order
    a rank happens to need them (mismatched collectives: wrong parameters or a hang) instead of the fixed
    order, on a group of their own."""
    for exact in run_distributed(_zero3_order_worker, 2):
        assert exact == [True, True, True]


def _window_worker(settings):
    """The Stack trained 3 steps per setting (DistributedDataParallelConfig fields): the final state, and in
    the third iteration the most non-root bytes held in full (gathered or in flight) at any hook, whether
    persistent parameters ever were placeholders after the first forward, and the gathers of one step."""
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.distributed import collectives

    rank = dist.get_rank()
    results = []
    for setting in settings:
        model = Stack()
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, **setting))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=True), [ddp])
        units = ddp.param_sync
        root = set(map(id, units.root + units.persistent))
        persistent = [p for b in units.persistent for p in b.params_list]
        held, placeholders = [], []

        def record(*_):
            held.append(sum(b.param_data.numel() * b.param_data.element_size() for b in units.all_buckets()
                            if id(b) not in root and (b.params_gathered or b.param_gather_handle is not None)))
            placeholders.append(any(torch.isnan(p).any() for p in persistent))
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda m, a: record())
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(record)
        gathers = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            held.clear()
            with collectives.observe(lambda name, t, n: gathers.append(id(t)) if name == "all_gather" else None):
                gathers.clear()
                _train_step(ddp, opt, x)
                ddp.finish_param_sync()
            placeholders.append(any(torch.isnan(p).any() for p in persistent))  # between iterations too
        unit_bytes = max(sum(b.param_data.numel() * b.param_data.element_size() for b in units.buckets[i])
                         for i in range(len(units.units)))
        per_bucket = {kind: [gathers.count(id(b.param_data)) for b in buckets] for kind, buckets in
                      (("units", [b for i in range(6) for b in units.buckets[i]]), ("root", units.root),
                       ("persistent", units.persistent))}
        results.append(dict(state={k: v.clone() for k, v in ddp.state_dict().items()}, max_held=max(held),
                            unit_bytes=unit_bytes, persistent=len(persistent), placeholders=any(placeholders),
                            gathers=per_bucket))
    return results


def test_prefetch_bucket_size_bounds_the_gathered_units_and_keeps_the_numbers():
    """Would catch a prefetch window that gathers more units than prefetch_bucket_size allows (peak memory
    above the window), one that is silently ignored (0 still prefetching, a large window gathering no more
    than the default), or a window that changes the numbers (the gathers' order or values): every setting
    trains bitwise like the default."""
    unit = 16 * 16 + 16
    settings = [{}] + [dict(prefetch_bucket_size=size) for size in (0, 2 * unit, 10 ** 9)]
    for results in run_distributed(_window_worker, 2, settings):
        default, none, two, every = results
        for r in results[1:]:
            assert r["state"].keys() == default["state"].keys()
            assert all(torch.equal(v, default["state"][k]) for k, v in r["state"].items())
        u = default["unit_bytes"]
        # in use + the window + (backward) one unit still receiving gradients
        assert none["max_held"] <= 2 * u and default["max_held"] <= 3 * u and two["max_held"] <= 4 * u
        assert every["max_held"] == 6 * u  # all six units dispatched at once: the window is used
        assert none["max_held"] < default["max_held"] < every["max_held"]


def test_persistent_parameters_are_never_released_and_train_the_same():
    """Would catch a parameter below param_persistence_threshold released (a NaN placeholder after its first
    gather, or gathered again in forward and backward), kept stale after the optimizer step (the state would
    differ), or persistence changing the numbers."""
    settings = [{}, dict(param_persistence_threshold=17)]  # every bias (16 or 3 elements), no weight
    for default, kept in run_distributed(_window_worker, 2, settings):
        assert kept["persistent"] == 8 and not kept["placeholders"]
        assert all(torch.equal(v, default["state"][k]) for k, v in kept["state"].items())
        # one step's gathers: each unit bucket twice (forward, backward), the root's once; the persistent
        # biases' buckets once (after the optimizer step), none in forward or backward
        for r in (default, kept):
            assert set(r["gathers"]["units"]) == {2} and set(r["gathers"]["root"]) == {1}, r["gathers"]
        assert kept["gathers"]["persistent"] and set(kept["gathers"]["persistent"]) == {1}


def test_max_reuse_distance_keeps_the_last_units_for_backward():
    """Would catch a unit kept from forward to backward that is gathered again anyway (no saving), one kept
    beyond max_reuse_distance (memory), a kept unit that backward reads stale or released (the numbers would
    differ from the default's), or kept units never released (the bound after backward)."""
    # A unit's bucket holds 16 * 16 + 16 = 272 elements, padded to at most 384. 0: the last unit (nothing
    # gathered between its forward and backward); 800: the last two (the last one's forward and backward in
    # between, 2 x 272..384 elements); 10 ** 9: all six
    settings = [{}] + [dict(max_reuse_distance=d) for d in (0, 800, 10 ** 9)]
    for default, last, two, every in run_distributed(_window_worker, 2, settings):
        for r in (last, two, every):
            assert all(torch.equal(v, default["state"][k]) for k, v in r["state"].items())
        for r, kept in ((default, 0), (last, 1), (two, 2), (every, 6)):
            assert sorted(r["gathers"]["units"]) == [1] * kept + [2] * (6 - kept), r["gathers"]
        u = default["unit_bytes"]
        assert last["max_held"] <= 3 * u and two["max_held"] <= 4 * u and every["max_held"] == 6 * u


ZERO3_TINY = tiny_pretrain_flags(micro_batch_size="1", train_iters="4", log_interval="1", overlap_grad_reduce=True,
                                 data_parallel_sharding_strategy="optim_grads_params")


def test_tunables_through_pretrain_gpt_train_and_resume_like_the_defaults(tmp_path):
    """Would catch a tunable that changes the numbers of pretrain_gpt.py's GPT, or breaks a torch_dist save and
    exact resume (persistent parameters sit in a bucket of their own, so the buffer order differs from the
    default's): the tiny GPT with all three tunables loses exactly what it loses without them."""
    tuned = ZERO3_TINY + ["--ddp-prefetch-bucket-size", "0", "--ddp-max-reuse-distance", "0",
                          "--ddp-param-persistence-threshold", "100"]
    straight = run_distributed(pretrain_losses, 2, ZERO3_TINY)[0]
    assert run_distributed(pretrain_losses, 2, tuned)[0] == straight
    run_distributed(pretrain_losses, 2, tuned + ["--save", str(tmp_path), "--exit-interval", "2"])
    resumed = run_distributed(pretrain_losses, 2, tuned + ["--load", str(tmp_path)])[0]
    assert sorted(resumed) == [3, 4] and all(resumed[i] == straight[i] for i in (3, 4))
