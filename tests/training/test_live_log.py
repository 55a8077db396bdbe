"""What a live recovery leaves in the log (megatron_lite/fault_tolerance/), without processes: the step
outcome a snapshot carries, TrainingLog's interval state taken up by a new log, and the soak's recovery records
(examples/live_soak.py). The supervisor run that holds the log lines, records and RNG to an uninterrupted run's
comes with the shared torchrun helper it needs.
"""

import json
import os
import re
import sys

import pytest
import torch


def log_lines(output) -> list:
    """The log lines of the training iterations, without their date and times (which no two runs share)."""
    lines = re.findall(r"iteration +\d+/ +\d+ \|[^\n]*", output)
    return [re.sub(r"elapsed time per iteration \(ms\): [\d.]+ \| throughput \(tokens/s\): \d+ \| ", "", line)
            for line in lines]


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
