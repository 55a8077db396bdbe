"""Fixtures shared by the live-recovery tests (test_live_recovery.py, test_elastic.py)."""

import pytest
from live_testing import ITERS, final_checkpoint, logged_losses, run_torchrun


@pytest.fixture(scope="session")
def live_reference(tmp_path_factory):
    """The uninterrupted run: `torchrun pretrain_gpt.py` with the live runs' flags, so that the live runs are held
    to what a user runs without the supervisor (the docs' "bit identical to the uninterrupted run"), torchrun's
    environment included (OMP_NUM_THREADS=1 when unset: the thread count changes the bits). Returns (its
    directory, {iteration: lm loss}, {iteration: validation lm loss}, the final checkpoint's files)."""
    directory = str(tmp_path_factory.mktemp("live_reference"))
    run_torchrun(directory)
    losses = logged_losses(directory)
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), losses
    valid = logged_losses(directory, "valid_lm_loss")
    assert sorted(valid) == [4, 8] and all(len(v) == 1 for v in valid.values()), valid
    return (directory, {iteration: values.pop() for iteration, values in losses.items()},
            {iteration: values.pop() for iteration, values in valid.items()}, final_checkpoint(directory))
