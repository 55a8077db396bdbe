"""What a live recovery leaves in the log, and the RNG it restores (megatron_lite/fault_tolerance/).

One supervisor run (dp=4, R=2, fp16 with its first two iterations skipped by the loss scaler, dropout on, a log
line every 4 iterations) in which rank 0 is replaced twice, and one uninterrupted `torchrun pretrain_gpt.py` of
the same flags. Rank 0 is the rank that writes the log: each replacement writes an iteration the survivors
completed before it (the catch-up) and then the rest of an interval whose start an earlier rank 0 saw:

    kill 1   rank 0 dies just before writing iteration 2 (a skipped one); the survivors have completed it
    kill 2   its replacement dies right after its update of iteration 6 (before the parameter all-gather):
             rank 1 failed in that all-gather with the update applied, so the iteration's outcome comes from
             the optimizer, not from train_step's return

The per-iteration records, the log lines (but their times), every loss, the final weights and every rank's
torch generator are compared with the uninterrupted run's. Also the soak's recovery records
(examples/live_soak.py) and the settled step outcome, without processes.
"""

import json
import os
import re
import sys
import time

import live_testing
import pytest
import torch
from live_testing import FLAGS as LIVE_FLAGS
from live_testing import (
    ITERS,
    PROGRESS_BOUNDED,
    check_exact,
    final_checkpoint,
    logged_losses,
    run_live,
    run_torchrun,
)

FLAGS = list(LIVE_FLAGS)
FLAGS[FLAGS.index("--log-interval") + 1] = "4"
FLAGS += ["--fp16", "--initial-loss-scale", str(2 ** 20), "--hysteresis", "1", "--hidden-dropout", "0.1",
          "--attention-dropout", "0.1"]
"""The live tests' configuration with a log line every 4 iterations, fp16 (2^20 overflows the first two
iterations: skipped, with no grad norm) and dropout (a healed rank must draw the dead rank's masks)."""

FAULTS = "0:2:log:0;0:6:update:new"


def records(directory) -> list:
    """The per-iteration records of the run's metrics.jsonl (not the timing or validation ones)."""
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "consumed_samples" in r]


def log_lines(output) -> list:
    """The log lines of the training iterations, without their date and times (which no two runs share)."""
    lines = re.findall(r"iteration +\d+/ +\d+ \|[^\n]*", output)
    return [re.sub(r"elapsed time per iteration \(ms\): [\d.]+ \| throughput \(tokens/s\): \d+ \| ", "", line)
            for line in lines]


def rng_states(directory) -> list:
    """Every rank's torch generator in the final checkpoint (python's and numpy's are not seeded by the run)."""
    common = torch.load(os.path.join(directory, f"iter_{ITERS:07d}", "common.pt"), weights_only=True)
    return [state["torch"] for state in common["rng_state"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    output = run_torchrun(directory, FLAGS)
    losses = {i: values.pop() for i, values in logged_losses(directory).items()}
    valid = {i: values.pop() for i, values in logged_losses(directory, "valid_lm_loss").items()}
    skipped = [r["iteration"] for r in records(directory) if r["skipped"]]
    assert skipped == [1, 2] and sorted(losses) == list(range(1, ITERS + 1)), output  # the premise of the scenario
    return directory, output, (losses, valid, final_checkpoint(directory))


@pytest.fixture(scope="module")
def rank_0_replaced_twice(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rank_0_replaced_twice")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(live_testing, "FLAGS", FLAGS)
        code, pids, losses, output = run_live(directory, FAULTS, supervisor_flags=["--spares", "0"])
    assert code == 0, output
    assert "killed at log" in output and "killed at update" in output and len(pids[0]) == 3, output
    return directory, output, losses


@PROGRESS_BOUNDED  # the supervisor and torchrun jobs: bounded by their progress (live_testing)
def test_catch_up_record_has_the_step_outcome(rank_0_replaced_twice, uninterrupted):
    """Every iteration's record (losses, lr, loss scale, grad norm, skipped, consumed samples) equals the
    uninterrupted run's, the catch-up records of iterations 2 (skipped by fp16) and 6 (the grad norm known to
    the survivors' optimizer only) included. Would catch: the catch-up record written with `grad_norm: null`
    and `skipped: false` (the step's outcome not carried in the survivors' snapshot), or the outcome of a step
    cut short by the failure not taken from the optimizer."""
    directory, output, _ = rank_0_replaced_twice
    expected = {r["iteration"]: r for r in records(uninterrupted[0])}
    seen = records(directory)
    assert sorted({r["iteration"] for r in seen}) == list(range(1, ITERS + 1)), output
    differing = [(r, expected[r["iteration"]]) for r in seen if r != expected[r["iteration"]]]
    assert not differing, f"records differ from the uninterrupted run's: {differing}\n{output}"


@PROGRESS_BOUNDED  # the supervisor and torchrun jobs: bounded by their progress (live_testing)
def test_log_lines_after_rank_0_is_replaced_equal_the_uninterrupted_runs(rank_0_replaced_twice, uninterrupted):
    """The lines at iterations 4 and 8 (loss averaged over the interval's unskipped iterations, the number of
    skipped iterations, grad norm, loss scale, learning rate) equal the uninterrupted run's although a new
    rank 0 wrote each of them after a re-forming inside its interval. Would catch: the interval's sums lost in
    a re-forming (a line averaging only the iterations since, 3.300885 printed for 3.289677), or a catch-up
    iteration counted as not skipped."""
    directory, output, _ = rank_0_replaced_twice
    expected = log_lines(uninterrupted[1])
    assert [line.split("|")[0] for line in expected] == [f"iteration        {i}/       8 " for i in (4, 8)]
    assert log_lines(output) == expected, output


@PROGRESS_BOUNDED  # the supervisor and torchrun jobs: bounded by their progress (live_testing)
def test_live_recovery_with_dropout_is_exact(rank_0_replaced_twice, uninterrupted):
    """With dropout on, every loss (validation too), the final weights and every rank's torch generator equal
    the uninterrupted run's. Would catch: a healed or replaced rank drawing other dropout masks than the dead
    rank would have (its generator not restored to the iteration it resumes from, or restored from another
    point), which the dropout-free live tests cannot see."""
    directory, output, losses = rank_0_replaced_twice
    check_exact(directory, uninterrupted[2], losses, output)
    expected = rng_states(uninterrupted[0])
    assert all(torch.equal(a, b) for a, b in zip(rng_states(directory), expected, strict=True)), output


# ------------------------------------------------------------------------------------ without processes
class _Optimizer:
    """What settled_progress reads of a MegatronOptimizer (an update of iteration 5 applied)."""

    def __init__(self, successful, grad_norm):
        self.steps_taken, self.last_step_successful, self.updating = 5, successful, False
        self.last_grad_norm = None if grad_norm is None else torch.tensor(grad_norm)
        self.param_groups = [{"lr": 0.0}]


@pytest.mark.parametrize("successful, grad_norm", [(True, 0.25), (False, None)])
def test_settled_progress_carries_the_step_outcome(successful, grad_norm):
    """A failure after the update of iteration 5 (in the parameter all-gather, before train_step returned):
    the settled record has the step's grad norm and whether fp16 skipped it. Would catch: a replacement rank 0
    logging that iteration with no grad norm, or as not skipped."""
    from megatron_lite.fault_tolerance.healing import Progress, settled_progress
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    optimizer = _Optimizer(successful, grad_norm)
    scheduler = OptimizerParamScheduler(optimizer, 1e-3, 1e-4, 2, 10, "cosine")
    scheduler.step(4)
    committed = Progress(4, 64, {}, scheduler.state_dict(), 4, {"lm loss": 4.0}, grad_norm=1.0)
    staged = Progress(5, 80, {}, {**scheduler.state_dict(), "num_steps": 5}, 5, {"lm loss": 5.0})
    settled = settled_progress(committed, staged, optimizer, scheduler)
    assert (settled.iteration, settled.grad_norm, settled.update_successful) == (5, grad_norm, successful)


def _live_soak():
    from pretrain_testing import REPO

    examples = os.path.join(REPO, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import live_soak

    return live_soak


def test_soak_reads_the_recovery_records_whatever_the_shared_log_holds():
    """examples/live_soak.py's parser of the ranks' recovery records: two records on one line, one cut by other
    output (not JSON), and a generation that started afresh (a re-forming before any rank held state: no
    'healed' mark). Would catch: the soak dying with a JSONDecodeError or `KeyError: 'healed'` (it did, in its
    double-failure section on a loaded machine) instead of leaving out what it cannot time."""
    soak = _live_soak()

    def record(rank, generation, **marks):
        marks = {"failed": 10.0, "joined": 11.0, "healed": 12.0, "redone": 13.5, **marks}
        return f"[rank {rank}] > recovered into generation {generation}: " + json.dumps(
            {"rank": rank, "generation": generation, "role": "survivor", **marks})

    log = "\n".join([record(1, 2), record(2, 2) + record(3, 2),
                     '[rank 0] > recovered into generation 2: {"rank": 0, "gen[W gloo] pair closed}',
                     record(0, 3, healed=None, failed=20.0, joined=21.0, redone=23.0)]).replace(', "healed": null', "")
    found = soak.recoveries(log)
    assert sorted(r["rank"] for r in found[2]) == [1, 2, 3] and [r["rank"] for r in found[3]] == [0]
    assert soak.split(found[2], 9.5) == {"detection": 0.5, "join": 1.0, "heal": 1.0, "redo": 1.5}
    assert soak.split(found[3], 19.0) == {"detection": 1.0, "join": 1.0, "heal": None, "redo": None}


def test_soak_waits_are_bounded_by_progress_and_use_the_supervisors_default_timeout(tmp_path, monkeypatch):
    """examples/fault_tolerance_soak.py's waits (live_soak.py's too): a job whose log keeps growing is waited for
    past the stall bound; one whose log stops growing ends the wait (TimeoutError); an exited job's code is
    returned. The live job gets the supervisor's default --collective-timeout. Would catch: fixed wall-time
    bounds (60, 300, 600 s), which a loaded machine exceeds with no fault, and the old `--collective-timeout 3`,
    which fires there with no fault (issue 32 items 13, 17)."""
    soak = _live_soak()
    log = tmp_path / "log.txt"

    class Job:
        returncode = None

        def poll(self):
            return self.returncode

    start = time.monotonic()

    def grows_then_done():
        with open(log, "a") as f:
            f.write("line\n")
        return time.monotonic() - start > 0.6 and "done"
    assert soak.wait_for(grows_then_done, Job(), [str(log)], "progress", stall_s=0.2) == "done"
    with pytest.raises(TimeoutError, match="no progress for 0 s"):
        soak.wait_for(lambda: False, Job(), [str(log)], "a stalled job", stall_s=0.2)
    ended = Job()
    ended.returncode = 3
    assert soak.wait_for(None, ended, [str(log)], "the end") == 3
    started = []
    monkeypatch.setattr(soak.subprocess, "Popen", lambda cmd, **kwargs: started.append(cmd))
    soak.launch_live(str(tmp_path), 10, 5, None)
    assert "--collective-timeout" not in started[0] and "megatron_lite.fault_tolerance.launch" in started[0]


def test_recovery_record_is_written_whole_in_one_write(single_rank_group, tmp_path, monkeypatch):
    """A rank's recovery record reaches the shared output in one write() of the whole line. Would catch: the
    record printed in pieces (print() writes the text and the newline apart when Python's output is unbuffered),
    which another rank's output cuts: records of two ranks on one line, a record the soak cannot parse."""
    from megatron_lite.fault_tolerance import live_training

    writes, write = [], os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(data) or write(fd, data))
    timings = live_training.Timings(1.0)
    timings.mark("joined")
    with open(tmp_path / "out.txt", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        live_training._report(timings, 3)
    assert len(writes) == 1 and writes[0].startswith(b"[rank 0] > recovered into generation 3: {"), writes
    assert writes[0].endswith(b"}\n") and json.loads(writes[0].split(b": ", 1)[1])["joined"] > 1.0, writes


def test_interval_sums_carried_to_a_new_log_give_the_uninterrupted_line(single_rank_group, tmp_path, capsys):
    """TrainingLog's interval state taken up by a new log (a re-formed generation's): the line at the interval's
    end averages the whole interval and counts its skipped iteration, as one log over the interval does; an
    iteration recorded with write=False (rank 0 wrote it before it was replaced) adds to the sums and writes
    nothing. Would catch a line averaging only the iterations since the re-forming."""
    from argparse import Namespace

    from megatron_lite.training.metrics import TrainingLog

    def new_log(name):
        args = Namespace(train_iters=8, log_interval=4, global_batch_size=16, seq_length=32, tensorboard_dir=None,
                         metrics_file=str(tmp_path / name))
        return TrainingLog(args, torch.device("cpu"), 4, None)

    def record(log, iteration, **kwargs):  # iteration 1 skipped by fp16
        log.training(iteration, 16 * iteration, {"lm loss": 1.0 + 1 / iteration}, 1e-3, 1.0, 0.5, iteration != 1,
                     **kwargs)

    whole = new_log("whole.jsonl")
    for iteration in (1, 2, 3, 4):
        record(whole, iteration)
    expected = log_lines(capsys.readouterr().out)
    before = new_log("before.jsonl")  # the replaced rank 0's: it wrote iterations 1 to 3
    for iteration in (1, 2, 3):
        if iteration == 3:
            state = before.interval_state()  # what the survivors carry: the sums before iteration 3
        record(before, iteration)
    after = new_log("after.jsonl")
    after.load_interval_state(state)
    record(after, 3, timed=False, write=False)
    assert capsys.readouterr().out == "" and (tmp_path / "after.jsonl").read_text() == ""
    record(after, 4)
    assert log_lines(capsys.readouterr().out) == expected and "number of skipped iterations:   1" in expected[0]
