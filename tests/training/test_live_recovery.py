"""Live recovery (megatron_lite/fault_tolerance/): a killed rank is replaced while the others keep running.

Two supervisor runs (`python -m megatron_lite.fault_tolerance.launch`, dp=4, R=2) over
tests/support/live_worker.py, which kills ranks at chosen points, are checked against one uninterrupted
`pretrain()` of the same configuration (on the session's pool of 4 ranks, computed once): every iteration's
loss and the final checkpoint bitwise, and which ranks got a new process. Wall time goes to process start-up
(torch is imported by every new rank), so the scenarios share runs where they can: the four single failures
(forward/backward, update, save, the replacement killed while healing) happen one after another in one run,
each recovered before the next; the double failure ends in a whole-job restart and has its own run.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_losses, tiny_pretrain_flags

WORKER = os.path.join(REPO, "tests", "support", "live_worker.py")
ITERS = 8
FLAGS = tiny_pretrain_flags(train_iters=str(ITERS), global_batch_size="16", log_interval="100",
                            use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size="2000",
                            num_distributed_optimizer_instances="2", save_interval="4")
SINGLE_FAILURES = ";".join([
    "3:2:forward_backward:0",  # rank 3 during the forward/backward of iteration 2 ...
    "3:0:recv:spare1",  # ... its replacement (the warm spare) while receiving its shard
    "0:5:update:0",  # rank 0 right after its optimizer update of iteration 5
    "2:8:save:0",  # rank 2 during the periodic save after iteration 8
])


def run_live(directory, faults, timeout_s=100):
    """The supervisor's run in `directory`: (return code, {rank: [pids]}, {iteration: {losses}}, output)."""
    # Every failure here is a killed process, which gloo reports at once: the collective timeout only bounds a
    # hung peer, so it is long enough for the ranks' skew on a loaded machine (a spurious timeout would cost a
    # re-forming after the trouble grace).
    command = [sys.executable, "-m", "megatron_lite.fault_tolerance.launch", "--nproc-per-node", "4",
               "--collective-timeout", "10", "--join-timeout", "25", "--trouble-grace", "5", WORKER, *FLAGS,
               "--save", str(directory), "--load", str(directory)]
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


def logged_losses(directory):
    """{iteration: {every lm loss logged for it}} from the run's metrics.jsonl (a redone iteration may log twice)."""
    losses = {}
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            if "lm_loss" in record:
                losses.setdefault(record["iteration"], set()).add(record["lm_loss"])
    return losses


def final_checkpoint(directory):
    folder = os.path.join(directory, f"iter_{ITERS:07d}")
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.endswith(".distcp")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: plain pretrain() on 4 ranks of the session's pool (no process start-up of its
    own), so the live runs are held to the ordinary training loop, not only to an uninterrupted live run."""
    directory = str(tmp_path_factory.mktemp("reference"))
    run_distributed(pretrain_losses, 4, FLAGS + ["--save", directory, "--load", directory], timeout=120)
    losses = logged_losses(directory)
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), losses
    return {iteration: values.pop() for iteration, values in losses.items()}, final_checkpoint(directory)


@pytest.fixture(scope="module")
def single_failures(tmp_path_factory):
    """One live run with the four single failures of SINGLE_FAILURES, each recovered before the next."""
    directory = tmp_path_factory.mktemp("single_failures")
    return directory, run_live(directory, SINGLE_FAILURES)


def check_exact(directory, reference, losses, output):
    expected_losses, expected_weights = reference
    assert sorted(losses) == list(range(1, ITERS + 1)), output
    differing = {i: v for i, v in losses.items() if v != {expected_losses[i]}}
    assert not differing, f"losses differ from the uninterrupted run at {differing}\n{output}"
    assert final_checkpoint(directory) == expected_weights, "the final weights differ\n" + output


def test_kills_during_backward_update_and_save_are_recovered_live_and_exactly(single_failures, reference):
    """Rank 3 killed during the forward/backward of iteration 2, rank 0 right after its optimizer update of
    iteration 5 (before the parameter all-gather: the others may or may not have updated), rank 2 during the
    periodic save of iteration 8. Only the killed ranks get new processes and the run matches the
    uninterrupted one bitwise. Would catch: a survivor applying an update without the lost rank's gradient, a
    rank left one update behind the others (no roll-forward from a replica), an iteration completed by the
    survivors but never logged, the data position or RNG not restored for the redone iteration, a save
    interrupted and never redone, a healthy rank restarted."""
    directory, (code, pids, losses, output) = single_failures
    assert code == 0, output
    for phase in ("forward_backward", "update", "save"):
        assert f"killed at {phase}" in output, output
    assert len(pids[0]) == 2 and len(pids[1]) == 1 and len(pids[2]) == 2, output  # rank 3: the next test
    replaced = re.findall(r"\[supervisor\] generation \d+: replaced (\[.*\])", output)
    assert [r for r in replaced if r != "[]"] == ["[3]", "[3]", "[0]", "[2]"], output  # "[]": a re-forming only
    check_exact(directory, reference, losses, output)


def test_replacement_killed_while_healing(single_failures, reference):
    """In the same run, the replacement of rank 3 (the warm spare) dies while receiving its shard; a second
    replacement (a new process) heals, and the run still matches bitwise. Would catch: a survivor losing
    its carried state when a healing attempt fails, or giving up instead of waiting for the next
    generation."""
    directory, (code, pids, losses, output) = single_failures
    assert code == 0, output
    assert "killed at recv" in output, output
    assert len(pids[3]) == 3, output  # the original, the spare killed while healing, the one that healed
    assert re.search(r"\[supervisor\] rank 3: pid \d+ \(generation \d+, warm spare 1\)", output), output
    assert "recovered into generation" in output, output
    check_exact(directory, reference, losses, output)


def test_double_failure_falls_back_to_a_restart(tmp_path, reference):
    """Rank 3 dies, then rank 1 (the other holder of its shard) dies while sending it to the replacement: no
    replica is left, the workers say so and the supervisor restarts the whole job, which resumes from the last
    words the survivors wrote at the first failure (ranks 0, 1, 2: a complete set). Would catch: continuing
    with a shard that nobody holds, hanging in the healing, or a restart that loses iterations."""
    code, pids, losses, output = run_live(tmp_path, "3:3:forward_backward:0;1:0:send:0")
    assert code == 0, output
    assert "has no replica at iteration" in output and "restarting the whole job" in output, output
    assert "resumed from" in output and "last_words" in output, output
    check_exact(tmp_path, reference, losses, output)
