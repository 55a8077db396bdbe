"""Shared pieces of the live-recovery tests (tests/training/test_live_recovery.py, test_elastic.py): the
configuration, one supervisor run over tests/support/live_worker.py, and what is read back from its directory.

Every run is held to one uninterrupted plain `pretrain()` of the same configuration (the `live_reference`
fixture of tests/training/conftest.py, computed once per session on the session's pool of 4 ranks).
"""

import json
import os
import re
import subprocess
import sys

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


def run_live(directory, faults, supervisor_flags=(), timeout_s=100):
    """The supervisor's run in `directory`: (return code, {rank: [pids]}, {iteration: {losses}}, output)."""
    # Every failure here is a killed process, which gloo reports at once: the collective timeout only bounds a
    # hung peer, so it is long enough for the ranks' skew on a loaded machine (a spurious timeout would cost a
    # re-forming after the trouble grace).
    command = [sys.executable, "-m", "megatron_lite.fault_tolerance.launch", "--nproc-per-node", "4",
               "--collective-timeout", "10", "--join-timeout", "25", "--trouble-grace", "5", *supervisor_flags,
               WORKER, *FLAGS, "--save", str(directory), "--load", str(directory)]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "LIVE_FAULTS": faults}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO,
                              start_new_session=True)
    except subprocess.TimeoutExpired as e:  # the supervisor stops its workers on the way out (stop_all)
        pytest.fail(f"the live run did not finish within {timeout_s} s:\n{e.stdout}")
    output = done.stdout + done.stderr
    pids = {}
    for rank, pid in re.findall(r"\[supervisor\] rank (\d+): pid (\d+)", output):
        pids.setdefault(int(rank), []).append(int(pid))
    return done.returncode, pids, logged_losses(directory), output


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
