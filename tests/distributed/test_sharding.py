"""ZeRO-2 (data_parallel_sharding_strategy='optim_grads'): each rank keeps only its shard of the reduced
gradients; full-size gradients exist only while a bucket accumulates (across no_sync micro-batches too)
or is in flight."""

import pytest
import torch

from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags


def _zero2_worker(overlap):
    import torch.distributed as dist

    from ddp_testing import make_batches, make_model
    from megatron_lite.distributed.distributed_data_parallel import ZERO2_BUCKETS_IN_FLIGHT
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    runs = {}
    for strategy in ("optim", "optim_grads"):
        model, ddp, opt = build(dict(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap,
                                     bucket_size=1), dict(lr=1e-2, use_distributed_optimizer=True),
                                model=make_model())
        megatron_steps(ddp, opt, rank, dp, 2)  # learn the expected arrivals; the next backward overlaps
        allocated = []
        if strategy == "optim_grads":  # one micro-batch, no accumulation: the in-flight bound applies
            for p in model.parameters():  # after DDP's own hook: how many buckets hold full gradients now
                p.register_post_accumulate_grad_hook(lambda _p: allocated.append(
                    sum(b.grad_storage_allocated() for b in ddp.param_and_grad_buffers[0].buckets)))
            x, y = make_batches(dp, 1, seed=5)[rank][0]
            ddp.zero_grad_buffer()
            ((ddp(x) - y) ** 2).mean().backward()
            ddp.finish_grad_sync()
            max_allocated = max(allocated)
            allocated.clear()
        ddp.zero_grad_buffer()
        for i, (x, y) in enumerate(make_batches(dp, 2, seed=7)[rank]):
            if i == 0:
                with ddp.no_sync():
                    opt.scale_loss(((ddp(x) - y) ** 2).mean() / 2).backward()
            else:
                opt.scale_loss(((ddp(x) - y) ** 2).mean() / 2).backward()
        ddp.finish_grad_sync()
        buckets = ddp.param_and_grad_buffers[0].buckets
        runs[strategy] = dict(shards=[b.reduced_grad_shard.clone() for b in buckets],
                              freed=all(b.grad_data.untyped_storage().nbytes() == 0 for b in buckets),
                              persistent=sum(b.grad_shard.numel() for b in buckets) if strategy != "optim" else None,
                              numel=ddp.param_and_grad_buffers[0].numel,
                              max_allocated=max_allocated if strategy == "optim_grads" else None,
                              n_buckets=len(buckets), window=ZERO2_BUCKETS_IN_FLIGHT)
    same = all(torch.equal(a, b) for a, b in zip(runs["optim"]["shards"], runs["optim_grads"]["shards"]))
    return same, runs["optim_grads"]


@pytest.mark.parametrize("overlap", [False, True])
def test_zero2_keeps_only_the_reduced_shard(overlap):
    """Would catch ZeRO-2 shards that differ from ZeRO-1's reduce-scatter result (accumulation across
    no_sync micro-batches, scaling), full-size gradients that survive finish_grad_sync, or (with overlap)
    all buckets' full gradients alive at once during backward."""
    for same, zero2 in run_distributed(_zero2_worker, 2, overlap):
        assert same and zero2["freed"]
        assert zero2["persistent"] * 2 == zero2["numel"]  # 1/dp of the (padded) gradients persists
        if overlap:
            assert zero2["n_buckets"] >= 6 and zero2["max_allocated"] <= zero2["window"] + 2


TINY = tiny_pretrain_flags(overlap_grad_reduce=True, ddp_bucket_size="2000")


_main = pretrain_losses  # pretrain_gpt.main on each rank: {iteration: lm loss}


def test_strategies_train_alike_and_checkpoints_move_between_them(tmp_path):
    """The tiny GPT (tied embeddings, 2 transformer layers as ZeRO-3 units) under every strategy (2 ranks,
    overlap, gradient accumulation): ZeRO-2 and ZeRO-3 equal ZeRO-1 bit for bit (the same reduced
    gradients reach the same sharded optimizer), plain DDP agrees to rounding. Checkpoints move between
    strategies and DP sizes. Would catch a strategy that drops, double-counts or mis-scales gradients, a
    stale or half-gathered parameter, or a checkpoint tied to its strategy."""
    losses = {s: run_distributed(_main, 2, TINY + ["--data-parallel-sharding-strategy", s])[0]
              for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
    assert losses["optim_grads"] == losses["optim"] == losses["optim_grads_params"]
    for i in range(1, 7):
        assert abs(losses["no_shard"][i] - losses["optim"][i]) <= 1e-5 * losses["optim"][i], i
    save = str(tmp_path / "ck")
    for saved_as, resumed_as, world in [("optim_grads", "no_shard", 1), ("optim_grads_params", "optim_grads", 2),
                                        ("no_shard", "optim_grads_params", 2)]:
        save = str(tmp_path / f"{saved_as}-{resumed_as}")
        run_distributed(_main, 2, TINY + ["--data-parallel-sharding-strategy", saved_as, "--save", save,
                                          "--exit-interval", "3"])
        resumed = run_distributed(_main, world, TINY + ["--data-parallel-sharding-strategy", resumed_as,
                                                        "--load", save])[0]
        assert sorted(resumed) == [4, 5, 6]
        for i in (4, 5, 6):
            assert abs(resumed[i] - losses["optim"][i]) <= 1e-4 * losses["optim"][i], (saved_as, resumed_as, i)


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=True), "use_distributed_optimizer"),
    (dict(data_parallel_sharding_strategy="zero2"), "data_parallel_sharding_strategy"),
])
def test_sharding_strategy_validation(kwargs, message):
    from megatron_lite import DistributedDataParallelConfig

    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**kwargs)


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


def _zero3_worker():
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, OptimizerConfig
    from megatron_lite import get_megatron_optimizer

    rank = dist.get_rank()
    results = {}
    for strategy in ("optim", "optim_grads_params"):
        model = Stack()
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
        gathered = []
        if strategy == "optim_grads_params":
            units = ddp.param_units
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
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            ddp.finish_grad_sync()
            opt.step()
        ddp.finish_param_sync()
        released = None
        if strategy == "optim_grads_params":
            released = (all(not b.params_gathered for b in ddp.param_units.all_buckets())
                        and all(torch.isnan(p).all() for p in model.parameters()))
        results[strategy] = dict(state={k: v.clone() for k, v in ddp.state_dict().items()}, released=released,
                                 max_gathered=max(gathered, default=None),
                                 units=len(ddp.param_units.units) if ddp.param_units else None)
    same = all(torch.equal(results["optim"]["state"][k], v) for k, v in results["optim_grads_params"]["state"].items())
    return same, results["optim_grads_params"]


def test_zero3_gathers_a_few_units_at_a_time_and_matches_zero1():
    """Would catch a unit left gathered after its forward or backward (peak memory = the whole model), a
    prefetch that gathers everything, a stale or half-written parameter (state differs from ZeRO-1's), or
    a released parameter that still holds (or silently reads as) real data."""
    for same, zero3 in run_distributed(_zero3_worker, 2):
        assert same and zero3["released"] and zero3["units"] == 6
        assert zero3["max_gathered"] <= 3, zero3["max_gathered"]  # the unit in use, the prefetched, one releasing


def _zero3_order_worker():
    import copy

    import torch.distributed as dist

    from ddp_testing import mean_of_rank_grads
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig
    from test_ddp_overlap import TwoBranches

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
