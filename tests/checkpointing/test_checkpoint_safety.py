"""Checkpoints never lose or shadow data and never load silently corrupt state; failures on one rank stop
every rank at once."""

import os
import stat
import sys
import time

import pytest
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_outcome, tiny_pretrain_flags

TINY = tiny_pretrain_flags(num_layers="1", global_batch_size="4", train_iters="4", log_interval="2")


def _run(argv, world=2):
    return run_distributed(pretrain_outcome, world, argv)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
@pytest.mark.parametrize("tracker", ["deleted", "garbled", "stale"])
def test_resume_scans_for_the_newest_checkpoint_whatever_the_tracker_says(tmp_path, tracker, ckpt_format):
    """Would catch a resumed run that starts from scratch because the tracker file was deleted or damaged
    (and then overwrites the checkpoints it should have loaded), or that resumes from an older one."""
    save = str(tmp_path / "ck")
    straight = _run(TINY + ["--train-iters", "6"])[0][1]
    _run(TINY + ["--train-iters", "6", "--save", save, "--save-interval", "2", "--exit-interval", "4",
                 "--ckpt-format", ckpt_format])
    path = os.path.join(save, "latest_checkpointed_iteration.txt")
    if tracker == "deleted":
        os.remove(path)
    else:
        open(path, "w").write("garbage\n" if tracker == "garbled" else "2\n")
    status, resumed = _run(TINY + ["--train-iters", "6", "--save", save, "--load", save])[0]
    assert status == "ok" and sorted(resumed) == [5, 6] and [resumed[5], resumed[6]] == [straight[5], straight[6]]


def test_a_run_never_shadows_checkpoints_it_did_not_load(tmp_path):
    """Would catch a fresh run (or one resumed from elsewhere) writing iter_* files into a directory whose
    newer checkpoints it never loaded: --load would then pick up the wrong run."""
    save = str(tmp_path / "ck")
    _run(TINY + ["--save", save])
    for argv in (TINY + ["--save", save], TINY + ["--save", save, "--load", str(tmp_path / "empty")]):
        for status, message in _run(argv):
            assert status == "error" and "did not resume from" in message and "--load" in message
    assert sorted(os.listdir(save)) == ["iter_0000004", "latest_checkpointed_iteration.txt", "metrics.jsonl"]


def test_exit_on_missing_checkpoint(tmp_path):
    for status, message in _run(TINY + ["--load", str(tmp_path / "nothing"), "--exit-on-missing-checkpoint"]):
        assert status == "error" and "no checkpoint" in message


@pytest.mark.parametrize("ckpt_format, victim", [("torch", "model_optim_rng.pt"), ("torch_dist", "__0_0.distcp"),
                                                   ("torch_dist", "common.pt")])
@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "empty"])
def test_corrupt_checkpoint_file_is_an_error_naming_it(tmp_path, damage, ckpt_format, victim):
    """Would catch a checkpoint loaded with silently wrong weights (a flipped byte in a tensor is still a
    valid pickle) or a confusing unpickling error instead of the file's name."""
    save = str(tmp_path / "ck")
    _run(TINY + ["--save", save, "--ckpt-format", ckpt_format], world=1)
    path = os.path.join(save, "iter_0000004", victim)
    data = bytearray(open(path, "rb").read())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data = b""
    open(path, "wb").write(bytes(data))
    status, message = _run(TINY + ["--train-iters", "6", "--save", save, "--load", save], world=1)[0]
    assert status == "error" and path in message and "corrupt" in message


def test_stale_temporary_directories_are_removed_and_files_are_group_readable(tmp_path):
    save = str(tmp_path / "ck")
    os.makedirs(os.path.join(save, ".tmp_iter_0000002_crashed"))
    _run(TINY + ["--save", save], world=1)
    assert sorted(os.listdir(save)) == ["iter_0000004", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    umask = os.umask(0)
    os.umask(umask)
    directory = os.path.join(save, "iter_0000004")
    for path, mode in [(directory, 0o777), (os.path.join(directory, "common.pt"), 0o666),
                       (os.path.join(directory, "__0_0.distcp"), 0o666),
                       (os.path.join(directory, "manifest.json"), 0o666)]:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode & ~umask, path


def test_schedule_and_hyperparameters_are_checked_on_resume(tmp_path):
    """Megatron's scheduler rule: a resumed run with another schedule or optimizer hyperparameters stops,
    unless told which to use. Would catch a silent change of the learning rate or weight decay."""
    save = str(tmp_path / "ck")
    _run(TINY + ["--save", save, "--exit-interval", "2"], world=1)
    for changed, needle in [(["--lr", "1e-2"], "max_lr"), (["--weight-decay", "0.3"], "weight_decay"),
                            (["--lr-decay-style", "linear"], "lr_decay_style")]:
        status, message = _run(TINY + changed + ["--save", save, "--load", save], world=1)[0]
        assert status == "error" and needle in message and "--override-opt_param-scheduler" in message
    status, losses = _run(TINY + ["--lr", "1e-2", "--save", str(tmp_path / "a"), "--load", save,
                                  "--use-checkpoint-opt_param-scheduler"], world=1)[0]
    assert status == "ok" and sorted(losses) == [3, 4]


def _rank0_data_failure_worker():
    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    real = pretrain_gpt.ensure_builtin_dataset

    def broken(*args):
        raise OSError("disk full (simulated)")

    if dist.get_rank() == 0:
        pretrain_gpt.ensure_builtin_dataset = broken
    start = time.monotonic()
    try:
        pretrain_gpt.main([f for f in TINY if f != "--mock-data"], world_size=dist.get_world_size())  # built-in corpus
    except (OSError, RuntimeError) as e:
        return str(e), time.monotonic() - start
    finally:
        pretrain_gpt.ensure_builtin_dataset = real
    return None, None


def test_rank0_failing_to_build_data_stops_every_rank_at_once():
    """Would catch the other ranks waiting at a barrier until the process-group timeout."""
    for message, seconds in run_distributed(_rank0_data_failure_worker, 2):
        assert message is not None and "disk full" in message and seconds < 20


def _failing_dist_save_worker(root):
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import torch_dist
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-3, use_distributed_optimizer=True))
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8, ckpt_format="torch_dist")
    real = torch_dist.dcp.save

    def crashing(state, checkpoint_id, process_group=None):
        real(state, checkpoint_id=checkpoint_id, process_group=process_group)
        if dist.get_rank() == 1:
            raise OSError("disk full (simulated)")

    torch_dist.dcp.save = crashing
    try:
        checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 16, ckpt_format="torch_dist")
    except (OSError, RuntimeError) as e:
        message = str(e)
    finally:
        torch_dist.dcp.save = real
    loaded = checkpointing.load_checkpoint(root, ddp, opt, sched)
    return message, loaded["iteration"], sorted(n for n in os.listdir(root) if not n.startswith(".tmp_"))


def test_torch_dist_save_failing_on_one_rank_keeps_the_previous_checkpoint(tmp_path):
    """Would catch a failure on a non-writing rank that leaves the others (or rank 0's tracker) believing the
    save succeeded: every rank must raise and the previous checkpoint must stay the newest."""
    for message, iteration, listing in run_distributed(_failing_dist_save_worker, 2, str(tmp_path)):
        assert "disk full" in message and iteration == 1
        assert listing == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def _sizes_worker(root):
    import torch

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        checkpointing,
        get_megatron_optimizer,
    )
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, fsdp_unit_modules=("Linear",)))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")
    ddp.zero_grad_buffer()
    ddp(torch.randn(2, 256)).pow(2).mean().backward()
    ddp.finish_grad_sync()
    opt.step()  # the Adam moments exist from here on
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8, ckpt_format="torch_dist")
    return sum(p.numel() for p in model.parameters())


def test_torch_dist_ranks_write_only_what_they_own(tmp_path):
    """ZeRO-3 on 2 ranks: each rank's file holds about half of the model and optimizer state (fp32 params,
    main params and two moments: 16 bytes per parameter in all). Would catch a rank writing everything
    (gathered state) or duplicated tensors."""
    numel = run_distributed(_sizes_worker, 2, str(tmp_path))[0]
    directory = tmp_path / "iter_0000001"
    sizes = [os.path.getsize(directory / f"__{r}_0.distcp") for r in range(2)]
    assert all(0.35 * 16 * numel < size < 0.65 * 16 * numel for size in sizes), (sizes, numel)


def test_async_torch_dist_save_resumes_bit_exact(tmp_path):
    """--async-save: the checkpoint is written in the background while training goes on, sealed before the
    next save and at the end; resuming from it repeats the uninterrupted run exactly. Would catch a write
    racing with training (tensors not staged), a checkpoint sealed before its files are complete, or an end
    of training that does not wait."""
    argv = TINY + ["--train-iters", "6", "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    straight = _run(argv)[0][1]
    save = str(tmp_path / "ck")
    _run(argv + ["--save", save, "--save-interval", "2", "--exit-interval", "4", "--async-save"])
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    status, resumed = _run(argv + ["--save", save, "--load", save, "--async-save"])[0]
    assert status == "ok" and [resumed[5], resumed[6]] == [straight[5], straight[6]]
    assert os.path.exists(os.path.join(save, "iter_0000006", "manifest.json"))


def _rng_and_warnings_worker(root, ckpt_format):
    """Each rank seeds its generators differently and saves; the generators are then reset (alike on every
    rank) and the checkpoint loaded through the library API. Returns (the draws right after the save, the
    draws right after the load, the warnings the load emitted)."""
    import random
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand()

    def seed(value):
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value)

    _, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-3, use_distributed_optimizer=True))
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")
    seed(100 + dist.get_rank())
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8, ckpt_format=ckpt_format)
    saved = draws()
    seed(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointing.load_checkpoint(root, ddp, opt, sched)
    return saved, draws(), [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_each_rank_resumes_its_own_rng_state(tmp_path, ckpt_format):
    """After load_checkpoint every rank's generators (torch, Python, numpy) continue from the state that rank
    saved. Would catch every rank getting rank 0's state (dropout masks then repeat across ranks), or the
    RNG not being restored at all."""
    results = run_distributed(_rng_and_warnings_worker, 2, str(tmp_path), ckpt_format)
    assert results[0][0] != results[1][0]  # the ranks' streams differ, so rank 0's state would be noticed
    for rank, (saved, resumed, _) in enumerate(results):
        assert resumed == saved, rank


def test_torch_dist_load_warns_of_no_sharded_tensor_deprecation(tmp_path):
    """torch warns that ShardedTensor is deprecated whenever DCP loads one: a user saw the same warning at every
    resume, about an internal choice of ours (torch_dist.py stores shards as ShardedTensors on purpose). Would
    catch the warning coming back (the filter around our DCP call dropped), or a file the load leaves open."""
    for _, _, caught in run_distributed(_rng_and_warnings_worker, 2, str(tmp_path), "torch_dist"):
        assert not [w for w in caught if "ShardedTensor" in w or w.startswith("ResourceWarning")], caught


def test_stale_temporary_entries_of_any_kind_are_removed_and_links_never_followed(tmp_path):
    """What a crashed save (or anything else) left under a temporary name in --save is removed by the next save:
    a directory, a file, a FIFO, and symbolic links, which are unlinked and never followed. Would catch
    `OSError: Cannot call rmtree on a symbolic link` (naming no path) on every later save, or a link's target
    (outside the checkpoint) deleted with it."""
    from megatron_lite.checkpointing import files

    root, outside = tmp_path / "ck", tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "keep.txt").write_text("precious")
    (outside / "file.txt").write_text("precious")
    root.mkdir()
    os.symlink(outside / "dir", root / ".tmp_iter_0000001_link_to_dir")
    os.symlink(outside / "file.txt", root / ".tmp_link_to_file")
    os.symlink(tmp_path / "nowhere", root / ".tmp_dangling")
    os.mkfifo(root / ".tmp_fifo")
    (root / ".tmp_iter_0000001_crashed").mkdir()
    os.symlink(outside / "dir", root / ".tmp_iter_0000001_crashed" / "inner_link")
    tmp_dir = files.new_directory(str(root), 2)
    assert os.listdir(root) == [os.path.basename(tmp_dir)]
    assert (outside / "dir" / "keep.txt").read_text() == (outside / "file.txt").read_text() == "precious"


def test_a_stale_temporary_entry_that_cannot_be_removed_is_named(tmp_path, monkeypatch):
    """Would catch the save failing with the filesystem's bare error (`OSError: [Errno 16] Device or resource
    busy`, no path), which leaves the user to guess what to remove."""
    import errno
    import shutil

    from megatron_lite.checkpointing import files

    stale = tmp_path / ".tmp_iter_0000001_crashed"
    stale.mkdir()

    def busy(path, *args, **kwargs):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
    monkeypatch.setattr(shutil, "rmtree", busy)
    with pytest.raises(OSError, match=f"cannot remove {stale}.*remove it by hand"):
        files.new_directory(str(tmp_path), 2)


HOLD_LOCK = """
import os, sys
from megatron_lite.checkpointing import files
files.lock_save_directory(sys.argv[1])
child = os.fork()  # like a DataLoader worker: inherits the descriptors, and lives on after the parent dies
if child == 0:
    sys.stdin.read()
    os._exit(0)
print(os.getpid(), child, flush=True)
sys.stdin.read()
"""


def test_a_second_job_on_the_same_save_directory_is_refused_and_a_dead_holder_blocks_nothing(tmp_path):
    """A job whose --save another live process holds stops on every rank, naming the directory and the holder's
    pid and host; once the holder is killed (SIGKILL: no clean-up of its own) the directory is free at once,
    even while a child process it forked lives on. Would catch two jobs writing into one directory (each
    overwriting or shadowing the other's checkpoints), a lock that outlives a crash (a restart refused
    forever), or one inherited by forked DataLoader workers (a replaced rank 0 refused while they linger)."""
    import signal
    import socket
    import subprocess

    from megatron_lite.checkpointing import files

    save = str(tmp_path / "ck")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, save], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, child = map(int, holder.stdout.readline().split())  # the lock is held from here on
        outcomes = _run(TINY + ["--save", save])
        for status, message in outcomes:
            assert status == "error" and f"--save {save} is in use by another job" in message, message
            assert f"pid {pid} on {socket.gethostname()}" in message, message
        assert "ValueError" in outcomes[0][1] and "RuntimeError" in outcomes[1][1]
        assert not os.path.exists(os.path.join(save, "iter_0000004"))
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the forked child is alive, and holds the same descriptors
        files.lock_save_directory(save)  # this process now: the dead holder's lock is gone
        files.unlock_save_directory(save)
        status, _ = _run(TINY + ["--save", save])[0]
        assert status == "ok" and not os.path.exists(os.path.join(save, files.LOCK_FILENAME))
    finally:
        holder.kill()
        holder.stdin.close()  # ends the forked child
        holder.wait()


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_a_save_directory_without_lock_support_trains_unguarded_with_a_warning(tmp_path, monkeypatch, code):
    """On a filesystem that cannot lock (NFS without a lock daemon: ENOLCK; some FUSE mounts: EOPNOTSUPP,
    ENOSYS) the --save lock warns, naming the directory, and the job goes on without it. Would catch a guard
    that stops every job on such a filesystem ('cannot lock ...: No locks available') though nothing else
    there needs locks."""
    import errno
    import fcntl

    from megatron_lite.checkpointing import files

    def no_locks(fd, operation, *args):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    save = str(tmp_path / "ck")
    with pytest.warns(UserWarning, match=f"--save {save}: its filesystem does not support locks"):
        files.lock_save_directory(save)
    assert os.path.realpath(save) not in files._locked  # nothing held, nothing to release
    files.unlock_save_directory(save)
