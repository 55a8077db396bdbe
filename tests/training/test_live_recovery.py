"""Live recovery (megatron_lite/fault_tolerance/): a killed rank is replaced while the others keep running.

Two supervisor runs (`python -m megatron_lite.fault_tolerance.launch`, dp=4, R=2) over
tests/support/live_worker.py, which kills ranks at chosen points, are checked against one uninterrupted
`pretrain()` of the same configuration (on the session's pool of 4 ranks, computed once): every iteration's
loss and the final checkpoint bitwise, and which ranks got a new process. Wall time goes to process start-up
(torch is imported by every new rank), so the scenarios share runs where they can: the four single failures
(forward/backward, update, save, the replacement killed while healing) happen one after another in one run,
each recovered before the next; the double failure ends in a whole-job restart and has its own run.
"""

import re

import pytest
from live_testing import check_exact, run_live


@pytest.fixture(scope="module")
def reference(live_reference):
    return live_reference[1:]


SINGLE_FAILURES = ";".join([
    "3:2:forward_backward:0",  # rank 3 during the forward/backward of iteration 2 ...
    "3:0:recv:spare1",  # ... its replacement (the warm spare) while receiving its shard
    "1:4:evaluate:0",  # rank 1 during the evaluation after iteration 4 (before the periodic save)
    "0:5:update:0",  # rank 0 right after its optimizer update of iteration 5
    "2:8:save:0",  # rank 2 during the periodic save after iteration 8
])


@pytest.fixture(scope="module")
def single_failures(tmp_path_factory):
    """One live run with the four single failures of SINGLE_FAILURES, each recovered before the next."""
    directory = tmp_path_factory.mktemp("single_failures")
    return directory, run_live(directory, SINGLE_FAILURES)


def test_kills_during_backward_update_and_save_are_recovered_live_and_exactly(single_failures, reference):
    """Rank 3 killed during the forward/backward of iteration 2, rank 1 during the evaluation after iteration 4,
    rank 0 right after its optimizer update of iteration 5 (before the parameter all-gather: the others may
    or may not have updated), rank 2 during the periodic save of iteration 8. Only the killed ranks get new
    processes and the run matches the uninterrupted one bitwise, validation losses included. Would catch: a
    survivor applying an update without the lost rank's gradient, a rank left one update behind the others (no
    roll-forward from a replica), an iteration completed by the
    survivors but never logged, the data position or RNG not restored for the redone iteration, a save or an
    evaluation interrupted and never redone (or evaluation not run at all under the supervisor), a healthy
    rank restarted."""
    directory, (code, pids, losses, output) = single_failures
    assert code == 0, output
    for phase in ("forward_backward", "evaluate", "update", "save"):
        assert f"killed at {phase}" in output, output
    assert len(pids[0]) == 2 and len(pids[1]) == 2 and len(pids[2]) == 2, output  # rank 3: the next test
    replaced = re.findall(r"\[supervisor\] generation \d+: replaced (\[.*\])", output)[1:]  # [0]: the start
    assert [r for r in replaced if r != "[]"] == ["[3]", "[3]", "[1]", "[0]", "[2]"], output  # "[]": a re-forming only
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


# ---------------------------------------------------------------------------------------- the snapshot's progress
class _Optimizer:
    """What settled_progress reads of a MegatronOptimizer, and param_groups for the scheduler."""

    def __init__(self, steps_taken, successful=True, updating=False):
        self.steps_taken, self.last_step_successful, self.updating = steps_taken, successful, updating
        self.last_grad_norm = None
        self.param_groups = [{"lr": 0.0}]


@pytest.mark.parametrize("case", ["not_updated", "updated", "updated_and_scheduled", "skipped_by_fp16", "torn"])
def test_settled_progress_matches_the_optimizer_state(case):
    """A failure during iteration 5 (4 completed; the record of 5 staged just before optimizer.step()).
    Would catch: a rank whose update was applied reporting iteration 4 (healing would then load its
    iteration-5 state as 4 and apply iteration 5's update twice: the roll-forward), the schedule left one step
    behind the update (the failure came between optimizer.step() and scheduler.step()), the schedule stepped
    for an update fp16's loss scaler skipped (train_step does not step it then), or a torn update accepted."""
    from megatron_lite.fault_tolerance.healing import LiveRecoveryImpossible, Progress, settled_progress
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    optimizer = _Optimizer(steps_taken={"not_updated": 4, "torn": 4}.get(case, 5),
                           successful=case != "skipped_by_fp16", updating=case == "torn")
    scheduler = OptimizerParamScheduler(optimizer, 1e-3, 1e-4, 2, 10, "cosine")
    scheduler.step(4)
    committed = Progress(4, 64, {"rng": 4}, scheduler.state_dict(), 4, {"lm loss": 4.0}, last_saved=4)
    staged = Progress(5, 80, {"rng": 5}, {**scheduler.state_dict(), "num_steps": 5}, 5, {"lm loss": 5.0}, 4)
    if case == "updated_and_scheduled":
        scheduler.step()
    if case == "torn":
        with pytest.raises(LiveRecoveryImpossible, match="torn"):
            settled_progress(committed, staged, optimizer, scheduler)
        return
    settled = settled_progress(committed, staged, optimizer, scheduler)
    expected_iteration, expected_steps = (4, 4) if case in ("not_updated", "skipped_by_fp16") else (5, 5)
    if case == "skipped_by_fp16":
        expected_iteration = 5  # the iteration is done (its samples consumed, the loss scale lowered) ...
    assert settled.iteration == expected_iteration and settled.consumed == 16 * expected_iteration
    assert settled.steps_taken == (4 if case == "not_updated" else 5)
    assert scheduler.num_steps == settled.scheduler["num_steps"] == expected_steps  # ... but no scheduler step
    assert settled.last_saved == 4


def test_async_save_is_refused_under_the_supervisor():
    """Would catch --async-save silently ignored by the live loop (it saves synchronously: the flag would
    promise a background save that never happens)."""
    import argparse

    from megatron_lite.fault_tolerance.live_training import pretrain_live

    args = argparse.Namespace(async_save=True)
    with pytest.raises(ValueError, match="--async-save is not supported under live recovery"):
        pretrain_live(args, None, None, None)
