"""Fixtures shared by the live-recovery tests (test_live_recovery.py, test_elastic.py)."""

import pytest
from live_testing import uninterrupted


@pytest.fixture(scope="session")
def live_reference(tmp_path_factory):
    """The uninterrupted run: `torchrun pretrain_gpt.py` with the live runs' flags, so that the live runs are held
    to what a user runs without the supervisor (the docs' "bit identical to the uninterrupted run"), torchrun's
    environment included (OMP_NUM_THREADS=1 when unset: the thread count changes the bits). Returns (its
    directory, {iteration: lm loss}, {iteration: validation lm loss}, the final checkpoint's files)."""
    directory = str(tmp_path_factory.mktemp("live_reference"))
    return (directory, *uninterrupted(directory))
