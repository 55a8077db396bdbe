"""Sharding strategies: ZeRO-2 (data_parallel_sharding_strategy='optim_grads') keeps only each rank's shard of
the reduced gradients (full-size gradients exist only while a bucket accumulates, across no_sync micro-batches
too, or is in flight); every strategy trains the tiny GPT alike and its checkpoints load under every other;
strategy validation. ZeRO-3's units and gathers are tested in test_param_units.py."""

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags


def _zero2_worker(overlap):
    import torch.distributed as dist
    from ddp_testing import make_batches, make_model
    from optim_testing import build, megatron_steps

    from megatron_lite.distributed.grad_sync import ZERO2_BUCKETS_IN_FLIGHT

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
