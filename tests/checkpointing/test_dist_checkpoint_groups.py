"""torch_dist checkpoints when the data-parallel group is not the whole world (as under tensor or pipeline
parallelism): 4 gloo ranks in 2 data-parallel groups of 2, as blocks {0,1},{2,3} and interleaved {0,2},{1,3}.

The contract (torch_dist.py): megatron-lite has no tensor/pipeline-parallel offsets, so every
data-parallel group holds a replica of the same model, as a layer norm is replicated over tensor-parallel
ranks in megatron-core; the group holding rank 0 writes (replica 0), the others write nothing, and a save
where the groups' states differ raises on every rank. Each test round-trips SmallNet after two AdamW steps
and compares, bit for bit, every parameter, main parameter, moment and step count with what was saved.
"""

import os

import pytest
import torch
from distributed_helper import run_distributed

WORLD = 4
# Name -> the data-parallel groups, as lists of global ranks.
LAYOUTS = {
    "blocks": [[0, 1], [2, 3]],
    "interleaved": [[0, 2], [1, 3]],
    "world": [[0, 1, 2, 3]],
    "singles": [[0], [1], [2], [3]],
}
STRATEGIES = ["no_shard", "optim", "optim_grads_params"]
_groups = {}  # layout -> this rank's data-parallel group (created once per worker process)


def _dp_group(layout):
    """This rank's data-parallel group of `layout` (every rank creates every group: new_group is collective)."""
    import torch.distributed as dist

    if layout not in _groups:
        made = [(ranks, dist.new_group(ranks)) for ranks in LAYOUTS[layout]]
        _groups[layout] = next(group for ranks, group in made if dist.get_rank() in ranks)
    return _groups[layout]


def _build(layout, strategy, seed, instances=1, extra=False):
    """SmallNet (with `extra`: and an unused Linear more) wrapped over this rank's group of `layout`."""
    import torch.distributed as dist
    from ddp_testing import make_model

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    sharded = strategy != "no_shard"
    units = dict(fsdp_unit_modules=("Linear", "LayerNorm")) if strategy == "optim_grads_params" else {}
    group = _dp_group(layout)
    model = make_model(seed=seed)
    if extra:
        model.extra = torch.nn.Linear(2, 2)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=sharded, overlap_grad_reduce=True,
        bucket_size=40, num_distributed_optimizer_instances=instances, **units), data_parallel_group=group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=sharded), [ddp])
    sched = OptimizerParamScheduler(opt, 1e-2, 0.0, 0, 10, "constant")
    return ddp, opt, sched, dist.get_rank(group), dist.get_world_size(group)


def _snapshot(ddp, opt):
    """Full parameters, full fp32 optimizer state (main params, moments) and step counts, by name."""
    from optim_testing import full_state

    ddp.finish_param_sync()
    with ddp.full_parameters():
        params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return dict(params=params, state=full_state(opt), steps=opt.agreed_param_steps(), update_count=opt.update_count)


def _differences(a, b):
    """Names (and what) where snapshot `b` is not bitwise `a`."""
    out = [f"param {n}" for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    out += [f"optimizer {n}.{k}" for n, entry in a["state"].items() for k in entry
            if k not in b["state"].get(n, {}) or not torch.equal(entry[k], b["state"][n][k])]
    out += [f"{key}: {a[key]} != {b[key]}" for key in ("steps", "update_count") if a[key] != b[key]]
    return out


def _round_trip_worker(root, save_layout, save_strategy, load_layout, load_strategy, instances=1, async_save=False):
    """Train 2 steps in `save_layout` (every group on the same data), save (with `async_save`: in the
    background), then load into a fresh model (other initial weights) in `load_layout`; returns the
    differences from the saved state."""
    import torch.distributed as dist
    from optim_testing import megatron_steps

    from megatron_lite import checkpointing

    ddp, opt, sched, dp_rank, dp = _build(save_layout, save_strategy, seed=0, instances=instances)
    megatron_steps(ddp, opt, dp_rank, dp, 2)
    saved = _snapshot(ddp, opt)
    if async_save and "async" not in _groups:
        _groups["async"] = dist.new_group(backend="gloo")
    pending = checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 2 * dp, ckpt_format="torch_dist",
                                            async_group=_groups["async"] if async_save else None)
    if pending is not None:
        pending.wait()
    ddp, opt, sched, _, _ = _build(load_layout, load_strategy, seed=1)
    loaded = checkpointing.load_checkpoint(root, ddp, opt, sched)
    return dict(iteration=loaded["iteration"], differences=_differences(saved, _snapshot(ddp, opt)),
                writers=_writers(os.path.dirname(loaded["path"])))


def _writers(directory):
    """The global ranks whose files (__<rank>_0.distcp) hold tensor data of the checkpoint in `directory`."""
    from megatron_lite.checkpointing.torch_dist import SafeReader

    storage = SafeReader(directory).read_metadata().storage_data
    return sorted({int(info.relative_path.split("_")[2]) for info in storage.values()})


def _check_round_trip(tmp_path, *config, **kwargs):
    """Round trip (see _round_trip_worker); only ranks of the group holding rank 0 (replica 0) wrote data."""
    for rank, result in enumerate(run_distributed(_round_trip_worker, WORLD, str(tmp_path), *config, **kwargs)):
        assert result["iteration"] == 2, (rank, result)
        assert not result["differences"], (rank, result["differences"][:5])
        assert set(result["writers"]) <= set(LAYOUTS[config[0]][0]), (rank, result["writers"])


@pytest.mark.parametrize("layout", ["blocks", "interleaved"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_groups_of_two_round_trip_bit_exact(tmp_path, layout, strategy):
    """Would catch shards placed by global rank but described by data-parallel rank (DCP: "Number of local
    shards (1) does not match ... (0)" on one rank, the others waiting for the gloo timeout), the second
    group's replicas written too (DCP would keep whichever copy it likes), or a load that reads another data-
    parallel rank's range (the interleaved layout puts data-parallel rank 1 at global rank 2)."""
    _check_round_trip(tmp_path, layout, strategy, layout, strategy)


def test_groups_of_two_with_optimizer_instances(tmp_path):
    """Two distributed-optimizer instances inside each group of two (instance 1 holds a copy of instance 0's
    shards): would catch the instances of the writing group both writing their shards (DCP rejects the
    overlap) or the load reading the other position's range."""
    _check_round_trip(tmp_path, "blocks", "optim", "interleaved", "optim", instances=2)


def test_groups_of_two_async_save(tmp_path):
    """--async-save stages copies of what the rank writes: would catch the staged ShardedTensors losing their
    global-rank placement, or a replica group staging (and writing) its state as well."""
    _check_round_trip(tmp_path, "interleaved", "optim_grads_params", "interleaved", "optim_grads_params",
                      async_save=True)


# (save layout, save strategy, load layout, load strategy)
RESHARD = [("blocks", "optim", "world", "optim_grads_params"),
           ("interleaved", "optim_grads_params", "singles", "no_shard"),
           ("blocks", "no_shard", "world", "optim"),
           ("world", "optim", "interleaved", "optim_grads_params"),
           ("singles", "no_shard", "blocks", "optim_grads_params")]


@pytest.mark.parametrize("config", RESHARD, ids=["-".join(c) for c in RESHARD])
def test_reshard_between_data_parallel_layouts(tmp_path, config):
    """Saved with one data-parallel layout, loaded with another size (dp=4, 4 groups of 1) and strategy,
    bit-exact on the fp32 values. Would catch pieces written by two groups or by none (a range missing from
    the checkpoint), or offsets that depend on the layout that saved them."""
    _check_round_trip(tmp_path, *config)


def _diverged_worker(root):
    """Groups {0,1} and {2,3} train on different data, then save together (must fail), then each group into a
    directory of its own with its data-parallel group as the checkpoint group (must round-trip)."""
    import os

    import torch.distributed as dist
    from optim_testing import megatron_steps

    from megatron_lite import checkpointing

    ddp, opt, sched, dp_rank, dp = _build("blocks", "optim", seed=0)
    index = dist.get_rank() // 2
    megatron_steps(ddp, opt, dp_rank, dp, 2, first_step=10 * index)
    try:
        checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 2 * dp, ckpt_format="torch_dist")
        error = None
    except ValueError as e:
        error = str(e)
    listing = sorted(os.listdir(root))
    dist.barrier()
    group, own = _dp_group("blocks"), os.path.join(root, f"group{index}")
    saved = _snapshot(ddp, opt)
    checkpointing.save_checkpoint(own, 2, ddp, opt, sched, 2 * dp, group=group, ckpt_format="torch_dist")
    ddp, opt, sched, _, _ = _build("blocks", "optim", seed=1)
    checkpointing.load_checkpoint(own, ddp, opt, sched, group=group)
    return dict(error=error, listing=listing, differences=_differences(saved, _snapshot(ddp, opt)))


def test_groups_holding_different_state_refuse_to_save(tmp_path):
    """A torch_dist checkpoint over several data-parallel groups keeps one replica. Would catch a save that
    silently keeps group {0,1}'s state and drops group {2,3}'s (that group would resume with the other's
    weights), an error raised on some ranks only (the others hang in DCP), or a half-made directory; and
    shows the way out: each group saved with its own checkpoint group round-trips bit-exactly."""
    for rank, result in enumerate(run_distributed(_diverged_worker, WORLD, str(tmp_path))):
        assert result["error"] is not None and "data-parallel group [2, 3] holds another" in result["error"], rank
        assert "save each group into a directory of its own" in result["error"]
        assert result["listing"] == [], (rank, result["listing"])
        assert not result["differences"], (rank, result["differences"][:5])


def _other_model_worker(root):
    """Save SmallNet from groups {0,1},{2,3}; load it where group {2,3} built a model with one more layer."""
    import torch.distributed as dist
    from optim_testing import megatron_steps

    from megatron_lite import checkpointing

    ddp, opt, sched, dp_rank, dp = _build("blocks", "optim", seed=0)
    megatron_steps(ddp, opt, dp_rank, dp, 1)
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, dp, ckpt_format="torch_dist")
    ddp, opt, sched, _, _ = _build("blocks", "optim", seed=1, extra=dist.get_rank() >= 2)
    try:
        checkpointing.load_checkpoint(root, ddp, opt, sched)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_load_into_another_model_in_one_group_raises_everywhere(tmp_path):
    """Would catch the group that finds a parameter missing raising alone while the other group walks into
    DCP's collectives and waits there for the process-group timeout."""
    for rank, error in enumerate(run_distributed(_other_model_worker, WORLD, str(tmp_path), timeout=60)):
        assert error is not None and "has no model.extra.weight" in error, (rank, error)


def _entry(rank, group, position, value=1):
    return {"rank": rank, "group": tuple(group), "position": position,
            "tensors": {"model.w": ((None, (2,), "torch.float32", value),)}}


def test_disagreement_names_the_problem():
    """The pure verdict every rank computes from the gathered descriptions (no processes): agreeing replicas
    pass; groups of different sizes, groups their members do not agree on, or another value on one rank
    are named."""
    from megatron_lite.checkpointing.torch_dist import disagreement

    agree = [_entry(0, [0, 2], 0), _entry(1, [1, 3], 0), _entry(2, [0, 2], 1), _entry(3, [1, 3], 1)]
    assert disagreement(agree) is None
    uneven = [_entry(0, [0, 1, 2], 0), _entry(1, [0, 1, 2], 1), _entry(2, [0, 1, 2], 2), _entry(3, [3], 0)]
    assert "differ in size ([0, 1, 2], [3])" in disagreement(uneven)
    torn = [_entry(0, [0, 1], 0), _entry(1, [1, 2], 0), _entry(2, [1, 2], 1), _entry(3, [3], 0)]
    assert "global rank 0 names its data-parallel group [0, 1]" in disagreement(torn)
    other = agree[:3] + [_entry(3, [1, 3], 1, value=2)]
    assert "group [1, 3] holds another model.w than group [0, 2] (global ranks 3 and 2" in disagreement(other)
