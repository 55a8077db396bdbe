"""Replicated distributed-optimizer state (num_distributed_optimizer_instances = R): the math matches one
instance, the replicas hold bitwise-identical shards, and a wiped shard is rebuilt from its replica in
memory with training continuing bit-identically."""

import pytest
import torch
from distributed_helper import run_distributed
from optim_testing import full_state, states_equal
from pretrain_testing import pretrain_losses, tiny_pretrain_flags


def _flat(opt):
    """The rank's shards (main params, moments, steps) as the one tensor a replica transfer sends."""
    from megatron_lite.optimizer.sharded_state import flatten
    return flatten(opt.sharded_state(), opt.device)


ADAM = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.05, log_num_zeros_in_grad=True, use_distributed_optimizer=True)


def _train(instances, strategy, steps, first_step=0, built=None):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    if built is None:
        units = dict(fsdp_unit_modules=("Linear", "LayerNorm")) if strategy == "optim_grads_params" else {}
        built = build(dict(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=40,
                           num_distributed_optimizer_instances=instances, **units), ADAM)
    _, ddp, opt = built
    norms = megatron_steps(ddp, opt, rank, dp, steps, first_step=first_step)
    return built, norms


def _equivalence_worker(strategy):
    import torch.distributed as dist

    results = {}
    for instances in (1, 2, 4):
        (model, ddp, opt), norms = _train(instances, strategy, 4)
        shards = [None] * dist.get_world_size()  # shard sizes differ between positions
        dist.all_gather_object(shards, _flat(opt))
        results[instances] = dict(norms=[n for _, n in norms], state=full_state(opt), shards=shards,
                                  per_instance=dist.get_world_size(opt.grad_stats_group))
    return results


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_instances_match_one_instance(strategy):
    """Would catch replicas counted twice in the gradient norm (clipping then scales by 1/sqrt(R): the clip
    threshold here is active), a shard never updated or reduced over one instance only, or replicas that
    drift apart (their shards must be bitwise equal). Against R=1 the sums are ordered differently (a
    reduce-scatter over dp/R ranks, then an all-reduce over R), hence the fp32 tolerance."""
    for rank, results in enumerate(run_distributed(_equivalence_worker, 4, strategy)):
        one = results[1]
        for instances in (2, 4):
            run = results[instances]
            assert run["per_instance"] == 4 // instances
            for a, b in zip(one["norms"], run["norms"]):
                assert a == pytest.approx(b, rel=1e-5)
            for name, entry in one["state"].items():
                for key, value in entry.items():
                    torch.testing.assert_close(run["state"][name][key], value, rtol=1e-5, atol=1e-6)
            m = run["per_instance"]
            for r, shard in enumerate(run["shards"]):  # every replica of rank r's shards is bitwise rank r's
                assert torch.equal(shard, run["shards"][r % m]), (instances, r)


def _shared_groups_worker():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from optim_testing import build

    from megatron_lite.distributed import collectives

    config = dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    first = build(config, ADAM)[1].data_parallel_groups
    groups_before = len(c10d._world.pg_map)
    second = build(config, ADAM)[1].data_parallel_groups
    shared = (second.intra_instance_group is first.intra_instance_group
              and second.inter_instance_group is first.inter_instance_group
              and len(c10d._world.pg_map) == groups_before)
    collectives.forget_instance_groups()
    third = build(config, ADAM)[1].data_parallel_groups
    afresh = third.intra_instance_group is not first.intra_instance_group
    ranks = (dist.get_process_group_ranks(third.intra_instance_group),
             dist.get_process_group_ranks(third.inter_instance_group))
    return shared, afresh, ranks


def test_wrappers_share_the_instance_groups():
    """Would catch every DistributedDataParallel creating its own intra- and inter-instance gloo groups
    (torch.distributed keeps each until destroy_process_group: a process building many wrappers, model chunks
    or a test's models, piles up sockets and threads), or forget_instance_groups not dropping them."""
    results = run_distributed(_shared_groups_worker, 4)
    assert [r[:2] for r in results] == [(True, True)] * 4
    assert [r[2] for r in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]


def _num_zeros_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    out = {}
    for instances in (1, 2):
        _, ddp, opt = build(dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=instances),
                            ADAM)
        megatron_steps(ddp, opt, dist.get_rank(), dist.get_world_size(), 1)
        ddp.zero_grad_buffer()
        for p in ddp.module.parameters():
            p.main_grad.fill_(1.0)
            p.main_grad.view(-1)[0] = 0.0  # one zero per parameter
        _, _, zeros = opt.step()
        out[instances] = zeros
    return out


def test_num_zeros_counts_each_element_once():
    """Would catch num_zeros summed over every replica (R times the true count)."""
    for result in run_distributed(_num_zeros_worker, 4):
        assert result[2] == result[1] == sum(1 for _ in _param_names())


def _param_names():
    from ddp_testing import make_model
    return [n for n, _ in make_model().named_parameters()]


def _rebuild_worker(source):
    """Train 3 steps, wipe rank 1's shard, restore it from `source`, train 3 more."""
    import torch.distributed as dist

    rank = dist.get_rank()
    reference, _ = _train(2, "optim", 6)
    reference_state = full_state(reference[2])

    built, _ = _train(2, "optim", 3)
    opt = built[2]
    before = _flat(opt)
    error = None
    if rank == 1:  # lose everything this rank held of the optimizer
        for shard in opt.shard_state.main_shards:
            shard.main.data.fill_(float("nan"))
            opt.optimizer.state.pop(shard.main, None)
    if source == "nan-replica" and rank == 3:
        poisoned = opt.shard_state.main_shards[0].main.data.clone()
        opt.shard_state.main_shards[0].main.data.fill_(float("inf"))
    try:
        if rank == 1:
            opt.recv_shard_state(src=1 if source == "self" else 0 if source == "non-replica" else 3)
        elif rank == (0 if source == "non-replica" else 3):
            opt.send_shard_state(dst=1)
    except ValueError as e:
        error = str(e)
    if source == "nan-replica" and rank == 3:
        opt.shard_state.main_shards[0].main.data.copy_(poisoned)
    if source != "replica":
        return dict(error=error, nan=bool(torch.isnan(_flat(opt)).any()))
    restored = torch.equal(_flat(opt), before)
    _train(2, "optim", 3, first_step=3, built=built)
    state = full_state(opt)
    same = states_equal(state, reference_state)
    return dict(error=error, restored=restored, same=same)


def test_rebuild_a_wiped_shard_from_its_replica():
    """Would catch a transfer that misses a moment or the step count, writes the params but not the model's
    shard, or pairs the wrong ranks: training after the rebuild must be bitwise the uninterrupted run's."""
    results = run_distributed(_rebuild_worker, 4, "replica")
    assert all(r["error"] is None for r in results)
    assert results[1]["restored"]
    assert all(r["same"] for r in results)


@pytest.mark.parametrize("source", ["non-replica", "nan-replica"])
def test_rebuild_refuses_a_wrong_or_damaged_source(source):
    """Would catch restoring from a rank that holds other shards (silently wrong parameters) or from a
    corrupt replica (NaN/Inf restored, an endless restart loop)."""
    results = run_distributed(_rebuild_worker, 4, source)
    assert "recv_shard_state" in results[1]["error"]
    if source == "non-replica":
        assert "send_shard_state" in results[0]["error"]
    else:
        assert results[3]["error"] is None


def _no_shard_rebuild_worker(source, optimizer):
    """no_shard (every rank a replica of every other) with `optimizer`: train 3 steps, wipe rank 1's state,
    restore it from rank 0 (`source` "nan-replica": rank 0's main params poisoned), train 3 more."""
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    config = {**ADAM, "use_distributed_optimizer": False, "optimizer": optimizer}

    def train(steps, first_step=0, built=None):
        built = built or build(dict(overlap_grad_reduce=True, bucket_size=40), config)
        megatron_steps(built[1], built[2], rank, dp, steps, first_step=first_step)
        return built

    reference = full_state(train(6)[2])
    built = train(3)
    opt, error = built[2], None
    main = opt.shard_state.main_shards[0].main
    if rank == 1:
        for shard in opt.shard_state.main_shards:
            shard.main.data.fill_(float("nan"))
            opt.optimizer.state.pop(shard.main, None)
    elif source == "nan-replica":
        main.data.fill_(float("inf"))
    try:
        if rank == 1:
            opt.recv_shard_state(src=0)
        else:
            opt.send_shard_state(dst=1)
    except ValueError as e:
        error = str(e)
    if source == "nan-replica":
        return dict(error=error)
    train(3, first_step=3, built=built)
    return dict(error=error, same=states_equal(full_state(opt), reference))


@pytest.mark.parametrize("source, optimizer", [("replica", "adam"), ("replica", "muon"), ("nan-replica", "adam")])
def test_no_shard_rebuilds_a_wiped_rank_from_another(source, optimizer):
    """The non-sharded optimizers (no_shard: every rank holds all the state) restore a rank from any other by
    the replica transfer live recovery heals with (send_shard_state / recv_shard_state; they had none: a
    no_shard job under the supervisor fell back to a whole-job restart at its first failure). Would catch a
    transfer that misses the state or the step count, or that does not write the model's parameters: training
    after the rebuild is bitwise the uninterrupted run's; a corrupt source is refused."""
    results = run_distributed(_no_shard_rebuild_worker, 2, source, optimizer)
    if source == "replica":
        assert all(r["error"] is None and r["same"] for r in results), results
    else:
        assert "not finite" in results[1]["error"] and results[0]["error"] is None, results


def _bad_config_worker(instances):
    from optim_testing import build

    try:
        build(dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=instances), ADAM)
    except ValueError as e:
        return str(e)
    return None


def test_instances_must_divide_dp():
    for message in run_distributed(_bad_config_worker, 4, 3):
        assert "num_distributed_optimizer_instances=3 does not divide the data-parallel size 4" in message


def test_config_rejects_bad_instances():
    from megatron_lite import DistributedDataParallelConfig

    with pytest.raises(ValueError, match="num_distributed_optimizer_instances must be >= 1"):
        DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=0)
    with pytest.raises(TypeError, match="num_distributed_optimizer_instances"):
        DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2.0)
    with pytest.raises(ValueError, match="requires use_distributed_optimizer"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)


# ---------------------------------------------------------------------------------------- checkpoints
# the tiny GPT of tests/checkpointing/test_reshard_matrix.py
TINY = tiny_pretrain_flags(micro_batch_size="1", train_iters="4", log_interval="2", overlap_grad_reduce=True,
                           ddp_bucket_size="2000")
_pretrain = pretrain_losses


def test_torch_dist_checkpoint_with_replicas(tmp_path):
    """Would catch replicas writing the same range twice (DCP rejects overlapping shards) or a load that
    reads another position's shards: saved at dp=4 R=2, resumed at R=2 (bit-exact), R=1 and dp=2."""
    replicas = TINY + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    straight = run_distributed(_pretrain, 4, replicas)[0]
    run_distributed(_pretrain, 4, replicas + ["--save", str(tmp_path), "--exit-interval", "2"])
    resumed = run_distributed(_pretrain, 4, replicas + ["--load", str(tmp_path)])[0]
    assert sorted(resumed) == [3, 4] and all(resumed[i] == straight[i] for i in (3, 4))
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
    for dp, extra in ((4, ["--use-distributed-optimizer"]), (2, zero3)):
        resumed = run_distributed(_pretrain, dp, TINY + extra + ["--load", str(tmp_path)])[0]
        assert all(abs(resumed[i] - straight[i]) <= 1e-5 * straight[i] for i in (3, 4)), (dp, extra)


def test_torch_format_checkpoint_with_replicas(tmp_path):
    """The gathered (torch) format assembles the full state inside one instance: saved at R=2, resumed at
    R=2 bit-exactly. Would catch a gather over the whole data-parallel group (replicas overlapping)."""
    replicas = TINY + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                       "--ckpt-format", "torch"]
    straight = run_distributed(_pretrain, 4, replicas)[0]
    run_distributed(_pretrain, 4, replicas + ["--save", str(tmp_path), "--exit-interval", "2"])
    resumed = run_distributed(_pretrain, 4, replicas + ["--load", str(tmp_path)])[0]
    assert sorted(resumed) == [3, 4] and all(resumed[i] == straight[i] for i in (3, 4))


@pytest.mark.parametrize("world, instances", [(1, 2), (4, 3), (2, 4)])
def test_flag_rejects_instances_not_dividing_dp(world, instances):
    from megatron_lite.training import build_parser, validate_args

    args = build_parser().parse_args(["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                                      str(instances)])
    with pytest.raises(ValueError, match=f"--num-distributed-optimizer-instances {instances} does not divide"):
        validate_args(args, world)
