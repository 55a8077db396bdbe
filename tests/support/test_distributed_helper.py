"""The test harness itself: the per-test timeout is live, and a rank that raises ends the call at once with
that rank's error (its peers, stuck in a collective, are not waited for until the process-group timeout)."""

import time

import pytest
from distributed_helper import FAILURE_GRACE_S, PROCESS_GROUP_TIMEOUT_S, run_distributed


def test_pytest_timeout_is_active(pytestconfig):
    """Would catch a suite run without pytest-timeout, where pytest.ini's `timeout` is inert and a hung test
    hangs CI for its whole budget (pip install -e '.[dev]' installs it)."""
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    assert float(pytestconfig.getini("timeout")) > 0


def _one_rank_raises():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits here for a peer that never comes


def _nothing():
    return None


def test_a_failing_rank_fails_the_call_fast_with_its_error():
    """Would catch a harness that waits for every rank (rank 0 stuck in a collective until the process-group
    timeout) or that reports a timeout instead of the failing rank's own error."""
    run_distributed(_nothing, 2)  # the pool is up: what is timed below is the failure alone
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 gives up"):
        run_distributed(_one_rank_raises, 2)
    assert time.monotonic() - start < FAILURE_GRACE_S + 10 < PROCESS_GROUP_TIMEOUT_S
