"""Last-words checkpoints: what the survivors of a failure write, which sets count as complete, and a job
killed under torchrun that restarts by itself and continues bit-identically."""

import hashlib
import json
import os
import sys

import pytest
from distributed_helper import run_distributed
from live_testing import PROGRESS_BOUNDED, wait_making_progress
from optim_testing import full_state, states_equal
from pretrain_testing import REPO


# ---------------------------------------------------------------------------------------- the consistency rules
def _fake_file(root, iteration, rank, world=4, per_instance=2, step=None, corrupt=False):
    """A rank file with a valid (or, corrupt, a mismatching) .json header; scan reads only the headers."""
    from megatron_lite.checkpointing import files

    directory = files.last_words_dir(str(root), iteration)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{rank:05d}.pt")
    data = f"state of rank {rank}".encode()
    with open(path, "wb") as f:
        f.write(data)
    header = {"size": len(data), "sha256": hashlib.sha256(b"other" if corrupt else data).hexdigest(),
              "iteration": iteration, "rank": rank, "world": world, "per_instance": per_instance,
              "position": rank % per_instance, "step": iteration if step is None else step}
    with open(path[:-3] + ".json", "w") as f:
        json.dump(header, f)


def test_complete_set_needs_every_position_once(tmp_path):
    """Would catch a set taken as complete although a shard is missing (training would resume with a shard
    of zeros or of another step), or a replica not accepted in place of a dead rank."""
    from megatron_lite.checkpointing import last_words

    for rank in (0, 1, 2):  # rank 3 died; its shard (position 1) survives on rank 1
        _fake_file(tmp_path, 30, rank)
    for rank in (0, 2):  # both holders of position 1 died
        _fake_file(tmp_path, 40, rank)
    sets, problems = last_words.scan(str(tmp_path))
    assert sorted(sets) == [30] and sorted(sets[30]) == [0, 1]
    assert "incomplete" in problems[40] and "position(s) [1]" in problems[40] and "rank(s) [1, 3]" in problems[40]


def test_files_of_two_data_parallel_sizes_complete_each_other(tmp_path):
    """An elastic job: ranks 1-3 of dp=4 wrote iteration 70; the job shrank to ranks 2 and 3, and when rank 3
    died too, rank 2 (rank 0 of the smaller job) wrote its position-0 shard again, as rank_00000. Would catch
    the set refused as inconsistent because two data-parallel sizes wrote it (the restart would go back to
    an older checkpoint), or files of another instance size mixed in."""
    from megatron_lite.checkpointing import last_words

    for rank in (1, 2, 3):
        _fake_file(tmp_path, 70, rank)
    _fake_file(tmp_path, 70, 0, world=2)
    _fake_file(tmp_path, 80, 0)
    _fake_file(tmp_path, 80, 1, world=4, per_instance=4)
    sets, problems = last_words.scan(str(tmp_path))
    assert sorted(sets) == [70] and sorted(sets[70]) == [0, 1] and len(sets[70][0]) == 2
    assert "inconsistent" in problems[80]


def test_inconsistent_or_damaged_files_are_refused(tmp_path):
    """Would catch shards at different optimizer steps combined into one state, or a damaged file used."""
    from megatron_lite.checkpointing import last_words

    _fake_file(tmp_path, 50, 0)
    _fake_file(tmp_path, 50, 1, step=49)
    _fake_file(tmp_path, 60, 0)
    _fake_file(tmp_path, 60, 1, corrupt=True)
    sets, problems = last_words.scan(str(tmp_path))
    assert sets == {}
    assert "inconsistent" in problems[50]
    assert "rank_00001.pt damaged" in problems[60] and "position(s) [1]" in problems[60]


# ---------------------------------------------------------------------------------------- write and load, in process
def _round_trip_worker(root):
    """dp=4, R=2: 6 uninterrupted steps vs 3 steps, last words of ranks 0-2 (rank 3 'dead'), a fresh model
    and optimizer loaded from them, 3 more steps."""
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    from megatron_lite.checkpointing import last_words
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()

    def fresh():
        ddp_kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40,
                          num_distributed_optimizer_instances=2)
        model, ddp, opt = build(ddp_kwargs, dict(lr=1e-2, use_distributed_optimizer=True))
        return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")

    def steps(ddp, opt, scheduler, first, n, words=None):
        for k in range(first, first + n):
            if words is not None:
                words.stage(k + 1, (k + 1) * 8)
            megatron_steps(ddp, opt, rank, dp, 1, first_step=k)
            scheduler.step()
            if words is not None:
                words.commit()

    ddp, opt, scheduler = fresh()
    steps(ddp, opt, scheduler, 0, 6)
    reference = full_state(opt)

    ddp, opt, scheduler = fresh()
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    steps(ddp, opt, scheduler, 0, 2, words)
    words.stage(3, 24)  # the third step completes, the failure comes before the loop commits it
    megatron_steps(ddp, opt, rank, dp, 1, first_step=2)
    scheduler.step()
    opt.updating = True  # a torn update writes nothing
    torn = words.write("test: torn")
    opt.updating = False
    written = words.write("test: rank 3 died") if rank != 3 else None
    dist.barrier()
    sets, problems = last_words.scan(root)

    ddp, opt, scheduler = fresh()
    loaded = last_words.load(sets[3], ddp, opt, scheduler)
    steps(ddp, opt, scheduler, 3, 3)
    same = states_equal(full_state(opt), reference)
    return dict(torn=torn, written=written, sets=sorted(sets), loaded=loaded["iteration"], used=loaded["path"],
                same=same, problems=problems)


def test_last_words_round_trip_is_bit_identical(tmp_path):
    """Would catch a record that does not match the shard (written between the update and the loop's commit),
    a torn update written, the dead rank not replaced by its replica, or anything lost on the way (moments,
    step, schedule): the continued run must be bitwise the uninterrupted one."""
    results = run_distributed(_round_trip_worker, 4, str(tmp_path))
    assert all(r["torn"] is None for r in results)
    assert [r["written"] is not None for r in results] == [True, True, True, False]
    assert all(r["sets"] == [3] and r["loaded"] == 3 and r["same"] for r in results)
    assert results[3]["used"].endswith("rank_00001.pt")  # the dead rank's shard came from its replica


# ---------------------------------------------------------------------------------------- a real failure
@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import fault_tolerance_soak
    return fault_tolerance_soak


ITERS = 40


@pytest.fixture(scope="module")
def reference(soak, tmp_path_factory):
    """The uninterrupted run's losses, shared by the torchrun tests below (one job start fewer)."""
    return soak.reference_losses(str(tmp_path_factory.mktemp("last_words_reference")), ITERS, 2)


@PROGRESS_BOUNDED  # the soak bounds its waits by the job's progress (fault_tolerance_soak.wait_for)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks to kill through /proc")
def test_killed_rank_restarts_and_continues_bit_identically(soak, reference, tmp_path):
    """torchrun --max-restarts 1, dp=4, R=2: rank 2 is killed with SIGKILL; the job restarts by itself, resumes
    from the survivors' last words at the iteration it had completed, and logs the uninterrupted run's
    losses. Then both holders of shard 1 die: the last words are incomplete, the job says so and falls back
    to the periodic checkpoint. Would catch a survivor that hangs or writes nothing, a restart that cannot
    rendezvous (stale store keys), lost iterations, or a resumed state that differs in any bit."""
    iters, interval = ITERS, 10
    row = soak.trial(str(tmp_path), "single", iters, 2, interval, 17, [2], reference)
    assert row["from"] == "last words" and row["lost"] == 0 and row["identical"], row
    row = soak.trial(str(tmp_path), "double", iters, 2, interval, 15, [1, 3], reference)
    assert row["from"] == "periodic" and row["identical"] and "survived on no rank" in row["note"], row


@PROGRESS_BOUNDED  # the soak bounds its waits by the job's progress (fault_tolerance_soak.wait_for)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun job")
def test_rank_raising_an_exception_restarts_and_continues(soak, reference, tmp_path):
    """A rank dies of an exception in iteration 13's forward (tests/support/pretrain_failing.py): it writes its
    own last words, the others theirs when their collectives fail, and the restarted job resumes at 12 with the
    uninterrupted run's losses. Would catch an except path that writes nothing or a stale record."""
    iters = ITERS
    job = soak.launch(str(tmp_path / "job"), iters, 2, 10, str(tmp_path / "log.txt"),
                      script=os.path.join(REPO, "tests", "support", "pretrain_failing.py"),
                      env={"FAIL_RANK": "1", "FAIL_AT": "13"})
    code = wait_making_progress(job, [str(tmp_path / "log.txt"), str(tmp_path / "job" / "metrics.jsonl")])
    assert code == 0, open(tmp_path / "log.txt").read()[-3000:]
    log = open(tmp_path / "log.txt").read()
    assert "[rank 1] > wrote last words at iteration 12" in log and "injected failure" in log
    assert soak.loaded_from(log) == "last words" and "at iteration 12 " in log.split("> resumed from", 1)[1]
    losses = {r["iteration"]: r["lm_loss"] for r in soak.records(str(tmp_path / "job" / "metrics.jsonl"))}
    assert sorted(losses) == list(range(1, iters + 1)) and losses == reference


def _subgroup_worker(root):
    import torch.distributed as dist
    from ddp_testing import make_model

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.checkpointing.last_words import LastWords
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp = DistributedDataParallel(make_model(), DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  data_parallel_group=groups[rank // 2])
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), ddp)
    try:
        LastWords(root, opt, OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant"), 0, 0)
    except ValueError as e:
        return str(e)
    return None


def test_last_words_refuse_several_data_parallel_groups(tmp_path):
    """Would catch last words written with two data-parallel groups: files are named by data-parallel rank, so
    each group's rank r would overwrite the other's file (a resume would mix two groups' shards)."""
    for error in run_distributed(_subgroup_worker, 4, str(tmp_path)):
        assert error is not None and "--no-last-words" in error


# ---------------------------------------------------------------------------------------- another data-parallel size
def _fresh(instances):
    from optim_testing import build

    from megatron_lite.training.scheduler import OptimizerParamScheduler

    ddp_kwargs = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40,
                      num_distributed_optimizer_instances=instances)
    model, ddp, opt = build(ddp_kwargs, dict(lr=1e-2, use_distributed_optimizer=True))
    return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")


def _write_at_dp2_worker(root):
    """dp=2, one instance of 2 ranks (what an elastic job of dp=4, R=2 shrinks to): 3 steps, last words."""
    import torch
    import torch.distributed as dist
    from optim_testing import megatron_steps

    from megatron_lite.checkpointing import last_words

    ddp, opt, scheduler = _fresh(1)
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    for k in range(3):
        words.stage(k + 1, (k + 1) * 8)
        megatron_steps(ddp, opt, dist.get_rank(), dist.get_world_size(), 1, first_step=k)
        scheduler.step()
        words.commit()
    words.write("test: the job stops")
    state = full_state(opt)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(root, "written.pt"))
    dist.barrier()


def _load_at_dp4_worker(root, instances):
    """dp=4 with `instances`: load the dp=2 set; (loaded iteration, state equal to the written one) or the error."""
    import torch

    from megatron_lite.checkpointing import last_words

    ddp, opt, scheduler = _fresh(instances)
    sets, problems = last_words.scan(root)
    try:
        loaded = last_words.load(sets[3], ddp, opt, scheduler)
    except ValueError as e:
        return str(e)
    return loaded["iteration"], states_equal(full_state(opt), torch.load(os.path.join(root, "written.pt")))


def test_last_words_load_at_another_data_parallel_size_with_the_same_instance_size(tmp_path):
    """A set written by 2 ranks in one instance loads into dp=4 with 2 instances of 2 (the elastic job growing
    back after a whole-job restart) with every tensor bitwise as written, and is refused, naming the rule, by dp=4
    with instances of 4. Would catch a loader that refuses any other data-parallel size (an elastic job's last
    words after a shrink would be unusable), or one that accepts a set cut for another instance size."""
    run_distributed(_write_at_dp2_worker, 2, str(tmp_path))
    assert run_distributed(_load_at_dp4_worker, 4, str(tmp_path), 2) == [(3, True)] * 4
    for error in run_distributed(_load_at_dp4_worker, 4, str(tmp_path), 1):
        assert "2 per instance; this job has 4 ranks, 4 per instance" in error
