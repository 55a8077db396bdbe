"""Loading agrees across ranks: a file that one rank cannot read ends every rank with its cause, or (last
words) makes every rank fall back together to a replica's file or the periodic checkpoint; never a hang."""

import contextlib
import hashlib
import io
import json
import os

import pytest
from distributed_helper import run_distributed
from optim_testing import full_state, states_equal
from pretrain_testing import REPO, tiny_pretrain_flags

# The distributed optimizer's DDP and optimizer configs (optim_testing.build's arguments).
DISTOPT_DDP = dict(use_distributed_optimizer=True, bucket_size=40)
DISTOPT = dict(lr=1e-2, use_distributed_optimizer=True)


def _fresh():
    from optim_testing import build

    from megatron_lite.training.scheduler import OptimizerParamScheduler

    _, ddp, opt = build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40,
                             num_distributed_optimizer_instances=2), dict(lr=1e-2, use_distributed_optimizer=True))
    return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")


def _steps(ddp, opt, scheduler, first, n, words=None):
    import torch.distributed as dist
    from optim_testing import megatron_steps

    for k in range(first, first + n):
        if words is not None:
            words.stage(k + 1, (k + 1) * 8)
        megatron_steps(ddp, opt, dist.get_rank(), dist.get_world_size(), 1, first_step=k)
        scheduler.step()
        if words is not None:
            words.commit()


def _unloadable(path):
    """Replace a last-words file by bytes torch.load refuses, with a .json that matches them (a file that
    passes its checksum but cannot be loaded: a bug in the writer, a forged file)."""
    data = b"PK\x03\x04 not a torch checkpoint"
    open(path, "wb").write(data)
    header = json.load(open(path[:-3] + ".json"))
    header.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    json.dump(header, open(path[:-3] + ".json", "w"))


def _damaged(path):
    """Flip a byte: the file no longer matches its .json."""
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _fallback_worker(root, unloadable, damaged):
    """dp=4, R=2: 6 uninterrupted steps vs a periodic checkpoint at 1 and last words at 3 (some files then
    made unloadable or damaged by rank 0), a fresh model loaded by load_checkpoint, trained on to 6."""
    import torch.distributed as dist

    from megatron_lite.checkpointing import files, last_words, load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    ddp, opt, scheduler = _fresh()
    _steps(ddp, opt, scheduler, 0, 6)
    reference = full_state(opt)

    ddp, opt, scheduler = _fresh()
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    _steps(ddp, opt, scheduler, 0, 1, words)
    save_checkpoint(root, 1, ddp, opt, scheduler, 8)
    _steps(ddp, opt, scheduler, 1, 2, words)
    words.write("test: the job died")
    dist.barrier()
    if rank == 0:
        for r in unloadable:
            _unloadable(os.path.join(files.last_words_dir(root, 3), f"rank_{r:05d}.pt"))
        for r in damaged:
            _damaged(os.path.join(files.last_words_dir(root, 3), f"rank_{r:05d}.pt"))
    dist.barrier()

    ddp, opt, scheduler = _fresh()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        loaded = load_checkpoint(root, ddp, opt, scheduler)
    _steps(ddp, opt, scheduler, loaded["iteration"], 6 - loaded["iteration"])
    return dict(iteration=loaded["iteration"], path=loaded["path"], log=log.getvalue(),
                same=states_equal(full_state(opt), reference))


@pytest.mark.parametrize("unloadable,damaged,iteration", [
    ((3,), (), 3),  # rank 3's own file cannot be loaded: rank 1's (same shards) replaces it
    ((), (3,), 3),  # rank 3's file fails its checksum: the same, and the log says so
    ((1, 3), (), 1),  # neither holder of shard position 1 can be read: every rank falls back to iteration 1
])
def test_unreadable_last_words_fall_back_on_every_rank_naming_the_file(tmp_path, unloadable, damaged, iteration):
    """Would catch the ranks that read an unloadable last-words file failing while the others wait in the
    next collective (a hang until the process-group timeout, the cause printed nowhere), a damaged file
    replaced by its replica without a word in the log, or a fallback taken by some ranks only. The run
    continued from whatever was loaded must be bitwise the uninterrupted one."""
    results = run_distributed(_fallback_worker, 4, str(tmp_path), unloadable, damaged)
    assert all(r["iteration"] == iteration and r["same"] for r in results)
    log = results[0]["log"]
    for r in (*unloadable, *damaged):
        assert f"rank_{r:05d}.pt" in log
    if iteration == 3:
        assert results[3]["path"].endswith("rank_00001.pt")
        assert ("read from a replica" if damaged else "rank 3 uses") in log
    else:
        assert "skipping the last words" in log and "falling back" in log
        assert all(r["path"].endswith("model_optim_rng.pt") for r in results)


# ---------------------------------------------------------------------------------------- periodic checkpoints
def _failing_read_worker(root, ckpt_format, victim):
    """dp=2: save at 2 steps, then load with a read failing on rank `victim` only (in DCP's read of the
    tensor data, or in the check of the files); returns the error each rank raised, and whether the ranks
    are still in step afterwards (a collective completes)."""
    import torch
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import files, load_checkpoint, save_checkpoint, torch_dist
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    def fresh():
        _, ddp, opt = build(DISTOPT_DDP, DISTOPT)
        return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")

    ddp, opt, scheduler = fresh()
    _steps(ddp, opt, scheduler, 0, 2)
    save_checkpoint(root, 2, ddp, opt, scheduler, 16, ckpt_format=ckpt_format)
    ddp, opt, scheduler = fresh()
    patches = []
    if dist.get_rank() == victim:
        def fail(*args, **kwargs):
            raise OSError("injected: input/output error")
        if ckpt_format == "torch_dist":
            patches.append((torch_dist.SafeReader, "read_data", fail))
        else:
            patches.append((files, "verify", fail))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        load_checkpoint(root, ddp, opt, scheduler)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    in_step = torch.ones(1)
    dist.all_reduce(in_step)
    return dict(error=error, in_step=int(in_step.item()), checkpointing=checkpointing.__name__)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_read_failing_on_one_rank_ends_every_rank_with_its_cause(tmp_path, ckpt_format):
    """Would catch a load that fails on one rank mid-way (a disk error inside torch.distributed.checkpoint's
    read, or in the checksum pass) while the other ranks go on into the next collective: the job would end
    only at the process-group timeout, with the original error in no rank's output."""
    results = run_distributed(_failing_read_worker, 2, str(tmp_path), ckpt_format, 1)
    assert all(r["error"] is not None and "injected: input/output error" in r["error"] for r in results)
    assert all(r["in_step"] == 2 for r in results)


def _other_layout_worker(root):
    """dp=4: last words written with R=2 instances, loaded by a job with R=1; returns each rank's error."""
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite.checkpointing import last_words, load_checkpoint
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    ddp, opt, scheduler = _fresh()
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    _steps(ddp, opt, scheduler, 0, 2, words)
    words.write("test: the job died")
    dist.barrier()
    _, ddp, opt = build(DISTOPT_DDP, DISTOPT)
    try:
        load_checkpoint(root, ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine"))
    except ValueError as e:
        return str(e)
    return None


def test_last_words_of_another_layout_are_an_error_naming_them_on_every_rank(tmp_path):
    """Would catch the ranks whose shard position the set does not have failing differently from the others
    (an empty path in their message, or a hang while the others wait), instead of one error on every rank
    that names the directory and the two layouts."""
    errors = run_distributed(_other_layout_worker, 4, str(tmp_path))
    where = os.path.join(str(tmp_path), "last_words", "iter_0000002")
    assert all(e is not None and where in e and "2 per instance" in e and "4 per instance" in e for e in errors)


# ---------------------------------------------------------------------------------------- through pretrain_gpt.py
TINY = tiny_pretrain_flags(num_layers="1", log_interval="1", use_distributed_optimizer=True,
                           num_distributed_optimizer_instances="2")


def _pretrain(argv, fail_at=None):
    """pretrain_gpt.main on this rank, every rank raising in its forward call `fail_at` (if given); returns
    (losses by iteration or the error, stdout)."""
    import sys

    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    original, calls = pretrain_gpt.forward_step, [0]

    def forward_step(data_iterator, model):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected failure")
        return original(data_iterator, model)

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            result = pretrain_gpt.pretrain(pretrain_gpt.parse_args(argv, dist.get_world_size()),
                                           pretrain_gpt.train_valid_test_datasets_provider,
                                           pretrain_gpt.model_provider, forward_step,
                                           pretrain_gpt.flops_per_iteration)
        return {i: r["lm loss"] for i, r in result["losses"].items()}, log.getvalue()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}", log.getvalue()


def test_pretrain_falls_back_past_unreadable_last_words_and_trains_on_exactly(tmp_path):
    """Would catch a restart that hangs (or dies) on the same unreadable last-words file every time, or one
    that falls back but then refuses to save next to the skipped set: dp=4, R=2, every rank fails in
    iteration 4 (last words at 3, periodic checkpoint at 2), both holders of shard position 1 are made
    unloadable, and the resumed run continues from iteration 2 with the uninterrupted run's losses."""
    from megatron_lite.checkpointing import files

    save = str(tmp_path / "ck")
    straight = run_distributed(_pretrain, 4, TINY)[0][0]
    failed = run_distributed(_pretrain, 4, TINY + ["--save", save, "--save-interval", "2"], 4)
    assert all(isinstance(losses, str) and "injected failure" in losses for losses, _ in failed)
    for rank in (1, 3):
        _unloadable(os.path.join(files.last_words_dir(save, 3), f"rank_{rank:05d}.pt"))
    resumed = run_distributed(_pretrain, 4, TINY + ["--save", save, "--load", save, "--save-interval", "2"])
    losses, log = resumed[0]
    assert isinstance(losses, dict), losses
    assert sorted(losses) == [3, 4, 5, 6] and all(losses[i] == straight[i] for i in losses)
    assert "rank_00001.pt" in log and "rank_00003.pt" in log and "falling back" in log


def _different_views_worker(root):
    """dp=2: a checkpoint at 2 that rank 1 does not see (as on a node without the shared filesystem)."""
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite.checkpointing import files, load_checkpoint, save_checkpoint
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    def fresh():
        _, ddp, opt = build(DISTOPT_DDP, DISTOPT)
        return ddp, opt, OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")

    ddp, opt, scheduler = fresh()
    _steps(ddp, opt, scheduler, 0, 2)
    save_checkpoint(root, 2, ddp, opt, scheduler, 16)
    original = files.find_latest
    if dist.get_rank() == 1:
        files.find_latest = lambda path: (None, None)
    try:
        load_checkpoint(root, *fresh())
        return None
    except ValueError as e:
        return str(e)
    finally:
        files.find_latest = original


def test_ranks_that_find_different_checkpoints_all_stop_naming_what_each_found(tmp_path):
    """Would catch a rank that sees no checkpoint (or another one) starting from scratch while the others
    load: the ranks would train from different states, or wait for each other in different collectives."""
    errors = run_distributed(_different_views_worker, 2, str(tmp_path))
    assert all(e is not None and "rank 0: periodic 2" in e and "rank 1: periodic None" in e for e in errors)
