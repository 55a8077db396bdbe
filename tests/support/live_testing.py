"""Shared pieces of the live-recovery tests (tests/training/test_live_recovery.py, test_elastic.py): the
configuration, one supervisor run over tests/support/live_worker.py, and what is read back from its directory.

Every run is held to one uninterrupted plain `torchrun pretrain_gpt.py` of the same flags (the `live_reference`
fixture of tests/training/conftest.py, computed once per session): what a user compares with.

Jobs are bounded by their progress, not by wall time (`wait_making_progress`): a run fails only when its
output and metrics have not grown for STALL_S seconds, so a loaded machine slows the suite down but does not
fail it, and a hang still ends.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from pretrain_testing import REPO, tiny_pretrain_flags

WORKER = os.path.join(REPO, "tests", "support", "live_worker.py")
ITERS = 8
FLAGS = tiny_pretrain_flags(train_iters=str(ITERS), global_batch_size="16", log_interval="100",
                            use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size="2000",
                            num_distributed_optimizer_instances="2", save_interval="4", eval_iters="1",
                            eval_interval="4")
"""dp=4 (R=2: 2 ranks per instance), 2 micro-batches of 2 per rank and iteration; after iterations 4 and 8 an
evaluation (one global batch), then a periodic save."""


STALL_S = 240.0
"""A job whose output and metrics have not grown for this long is taken for hung (the slowest step of these
jobs, a process start or a whole-job restart at load ~100 on 2 cores, is well below it)."""

PROGRESS_BOUNDED = pytest.mark.timeout(0)
"""For a test whose waits are all bounded by progress (wait_making_progress, or STALL_S): no pytest-timeout
wall-time bound (pytest.ini's 300 s, which a live run's fixture, counted in its first test, exceeds on a loaded
machine). A hang still ends: the job stops growing its log."""


def job_env(**extra):
    """The environment of a test job: the repository importable, and OMP_NUM_THREADS as the user's shell has
    it (unset, usually): the launcher (torchrun, the supervisor) decides the workers' threads, as for a user."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONPATH": REPO, **extra}


def start_job(command, log_path, env=None):
    """`command` in its own process group (a hung job can be stopped whole), stdout and stderr to `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or job_env(), cwd=REPO,
                                start_new_session=True)


def wait_making_progress(job, watched, stall_s=STALL_S, what="the job", until=None):
    """Wait for `job` (a Popen) to exit, as long as one of the `watched` files keeps growing (its log, its
    metrics): fail, after stopping its process group, when none has grown for `stall_s` seconds. Returns the
    exit code; with `until` (a callable), returns None, the job left running, as soon as `until()` is true."""
    sizes, last_progress, reached = None, time.monotonic(), False
    try:
        while job.poll() is None:
            if until is not None and until():
                reached = True
                return None
            now = [os.path.getsize(f) if os.path.exists(f) else -1 for f in watched]
            if now != sizes:
                sizes, last_progress = now, time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                tail = open(watched[0], errors="replace").read()[-4000:] if os.path.exists(watched[0]) else ""
                pytest.fail(f"{what} made no progress for {stall_s:.0f} s ({', '.join(map(str, watched))} "
                            f"unchanged); stopped. Its log ends:\n{tail}")
            time.sleep(0.2)
    finally:  # a stall, or the test interrupted (Ctrl-C, pytest-timeout): no process of the job is left behind
        if job.poll() is None and not reached:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.wait()
    return job.returncode


def run_live(directory, faults, supervisor_flags=(), collective_timeout="10", sigterm_at=None, log_name="job.log",
             flags=None):
    """The supervisor's run of pretrain_gpt.py `flags` (None: FLAGS, read at the call, so a test may patch it) in
    `directory`: (return code, {rank: [pids]}, {iteration: {losses}}, output). `collective_timeout` None: the
    supervisor's default. `sigterm_at`: a text; once the job's log holds it, the supervisor gets SIGTERM (as
    from `timeout`, Slurm, Kubernetes). Output to `log_name` in `directory`."""
    # Most failures here are killed processes, which gloo reports at once: the collective timeout bounds a hung
    # peer (the SIGSTOP fault's detection), so it is long enough for the ranks' skew on a loaded machine (a
    # spurious timeout would cost a re-forming after the trouble grace).
    # The join timeout must outlast the replacement of a rank that does not answer (collective timeout + trouble
    # grace, launch's start-up check): 25 s beside our 10 s, the supervisor's default beside its default.
    timeout = [] if collective_timeout is None else ["--collective-timeout", collective_timeout, "--join-timeout", "25"]
    command = [sys.executable, "-m", "megatron_lite.fault_tolerance.launch", "--nproc-per-node", "4", *timeout,
               "--trouble-grace", "5", *supervisor_flags,
               WORKER, *(FLAGS if flags is None else flags), "--save", str(directory), "--load", str(directory)]
    log_path = os.path.join(directory, log_name)
    job = start_job(command, log_path, job_env(LIVE_FAULTS=faults, LIVE_FAULTS_DIR=str(directory)))
    watched = [log_path, os.path.join(directory, "metrics.jsonl")]
    if sigterm_at is not None:
        def logged():
            return sigterm_at in open(log_path, errors="replace").read()
        if wait_making_progress(job, watched, what="the live run", until=logged) is None:
            os.kill(job.pid, signal.SIGTERM)
    code = wait_making_progress(job, watched, what="the live run")
    output = open(log_path, errors="replace").read()
    pids = {}
    for rank, pid in re.findall(r"\[supervisor\] rank (\d+): pid (\d+)", output):
        pids.setdefault(int(rank), []).append(int(pid))
    return code, pids, logged_losses(directory), output


def run_torchrun(directory, flags=FLAGS, nproc=4):
    """`torchrun pretrain_gpt.py flags --save/--load directory` (no fault, the user's plain path); returns its
    output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               os.path.join(REPO, "pretrain_gpt.py"), *flags, "--save", str(directory), "--load", str(directory)]
    log_path = os.path.join(directory, "job.log")
    code = wait_making_progress(start_job(command, log_path), [log_path, os.path.join(directory, "metrics.jsonl")],
                                what="the torchrun job")
    output = open(log_path, errors="replace").read()
    assert code == 0, output
    return output


def uninterrupted(directory, flags=None):
    """The reference of a live run of `flags`: `torchrun pretrain_gpt.py flags` in `directory`, without fault.
    Returns ({iteration: lm loss}, {iteration: validation lm loss}, the final checkpoint's files), what
    check_exact compares with."""
    run_torchrun(directory, FLAGS if flags is None else flags)
    losses = logged_losses(directory)
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), losses
    valid = logged_losses(directory, "valid_lm_loss")
    assert sorted(valid) == [4, 8] and all(len(v) == 1 for v in valid.values()), valid
    return ({iteration: values.pop() for iteration, values in losses.items()},
            {iteration: values.pop() for iteration, values in valid.items()}, final_checkpoint(directory))


def logged_losses(directory, key="lm_loss"):
    """{iteration: {every loss logged for it}} from the run's metrics.jsonl (a redone iteration may log twice);
    key "valid_lm_loss": the validation losses."""
    losses = {}
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            if key in record:
                losses.setdefault(record["iteration"], set()).add(record[key])
    return losses


def final_checkpoint(directory):
    """The final checkpoint's .distcp files, by name, as bytes."""
    folder = os.path.join(directory, f"iter_{ITERS:07d}")
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.endswith(".distcp")}


def check_exact(directory, reference, losses, output):
    """Every iteration logged, every loss (validation too) and the final checkpoint bitwise the uninterrupted
    run's."""
    expected_losses, expected_valid, expected_weights = reference
    assert sorted(losses) == list(range(1, ITERS + 1)), output
    differing = {i: v for i, v in losses.items() if v != {expected_losses[i]}}
    assert not differing, f"losses differ from the uninterrupted run at {differing}\n{output}"
    valid = logged_losses(directory, "valid_lm_loss")
    assert valid == {i: {v} for i, v in expected_valid.items()}, f"validation losses {valid}\n{output}"
    assert final_checkpoint(directory) == expected_weights, "the final weights differ\n" + output
