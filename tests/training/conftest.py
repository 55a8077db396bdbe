"""Fixtures shared by the live-recovery tests (test_live_recovery.py, test_elastic.py)."""

import pytest
from distributed_helper import run_distributed
from live_testing import FLAGS, ITERS, final_checkpoint, logged_losses
from pretrain_testing import pretrain_losses


@pytest.fixture(scope="session")
def live_reference(tmp_path_factory):
    """The uninterrupted run: plain pretrain() on 4 ranks of the session's pool (no process start-up of its
    own), so the live runs are held to the ordinary training loop, not only to an uninterrupted live run.
    Returns (its directory, {iteration: lm loss}, {iteration: validation lm loss}, the final checkpoint's files)."""
    directory = str(tmp_path_factory.mktemp("live_reference"))
    run_distributed(pretrain_losses, 4, FLAGS + ["--save", directory, "--load", directory], timeout=120)
    losses = logged_losses(directory)
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), losses
    valid = logged_losses(directory, "valid_lm_loss")
    assert sorted(valid) == [4, 8] and all(len(v) == 1 for v in valid.values()), valid
    return (directory, {iteration: values.pop() for iteration, values in losses.items()},
            {iteration: values.pop() for iteration, values in valid.items()}, final_checkpoint(directory))
