"""Elastic live recovery (`launch --min-instances`): shrink to the complete instances when a replacement is
late, grow back when it returns; the math is the uninterrupted run's up to the order of the sums.

One supervisor run (dp=4, R=2: instances {0, 1} and {2, 3}) over tests/support/live_worker.py, held to the
uninterrupted plain `pretrain()` of tests/training/conftest.py. The tolerances: the global batch is the same
samples at dp=2 (each rank then runs 4 micro-batches instead of 2), only the order of the gradient sums
differs, so a loss moves by an ulp or so (measured: at most 4.8e-7 absolute, 8.4e-8 relative, over 9
iterations at dp=2) and the weights by what Adam makes of it (measured: at most 2.0e-6 absolute after them).
The test allows 1e-6 relative and 2e-5 absolute.
"""

import argparse
import os
import re
import sys

import pytest
from live_testing import ITERS, logged_losses, run_live
from pretrain_testing import REPO

from megatron_lite.fault_tolerance.elastic import check_elastic, generation_args

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402

LOSS_RTOL, WEIGHT_ATOL = 1e-6, 2e-5


def job_args(**overrides):
    values = dict(num_distributed_optimizer_instances=2, data_parallel_size=4, micro_batch_size=2,
                  global_batch_size=16, num_micro_batches=2)
    return argparse.Namespace(**{**values, **overrides})


def test_generation_args_of_a_shrunk_job():
    """Would catch a shrunk generation built with the whole job's data-parallel size, instances or micro-batches
    per rank (the global batch would no longer be the same samples), or the job's arguments modified."""
    args = job_args()
    assert generation_args(args, 4) is args
    smaller = generation_args(args, 2)
    assert (smaller.data_parallel_size, smaller.num_distributed_optimizer_instances, smaller.num_micro_batches) \
        == (2, 1, 4)
    assert (args.data_parallel_size, args.num_distributed_optimizer_instances, args.num_micro_batches) == (4, 2, 2)


@pytest.mark.parametrize("overrides, minimum, names", [
    (dict(num_distributed_optimizer_instances=1, data_parallel_size=4), 1, "--num-distributed-optimizer-instances"),
    (dict(), 3, "--min-instances 3"),
    (dict(num_distributed_optimizer_instances=4, global_batch_size=8, num_micro_batches=1), 1, "--global-batch-size"),
])
def test_elastic_mode_refuses_what_it_cannot_shrink_to(overrides, minimum, names):
    """Would catch elastic mode accepted without replicas (a left-out instance's shards would be lost), with
    more instances required than the job has, or with a global batch that some smaller job cannot split into
    whole micro-batches (a hang or a changed batch later, at the shrink)."""
    with pytest.raises(ValueError, match=re.escape(names)):
        check_elastic(job_args(**overrides), minimum)
    check_elastic(job_args(), 1)  # dp=4, R=2, gbs 16, mbs 2: fine at one instance too


def model_weights(directory):
    return checkpoint_convert.read(directory)["model"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor's workers are killed by signal")
def test_shrink_then_grow(tmp_path, live_reference):
    """Rank 0 is killed during iteration 2 and its replacement comes back only once iteration 4 is logged
    (--replacement-timeout 1): the job shrinks to instance {2, 3} (rank 2 becomes rank 0 of the smaller job:
    it logs and saves), rank 1 waits, alive, to be admitted; after iteration 5 ranks 2 and 3 wait until the
    supervisor grows the job, they leave together at its iteration boundary, and ranks 0 and 1 are healed from
    instance {2, 3}. Would catch: the survivors waiting for the replacement instead of shrinking, a shrunk job
    training on other samples or another batch size (the losses would differ far beyond an ulp), a healthy
    process restarted, a rank renumbered onto another shard position, a parked rank not admitted or not healed,
    the grow losing or repeating an iteration, a periodic save during the shrink missing."""
    reference_dir, expected_losses, expected_valid, _ = live_reference
    faults = "0:2:forward_backward:0;0:4:hold:new;2:5:grow:0;3:5:grow:0"
    code, pids, losses, output = run_live(tmp_path, faults, ["--spares", "0", "--min-instances", "1",
                                                             "--replacement-timeout", "1"])
    assert code == 0, output
    assert re.search(r"generation \d+: replaced \[\], members \[2, 3\] \(shrink: rank\(s\) \[0\]", output), output
    assert re.search(r"generation \d+: replaced \[\] \(grow: ", output), output
    assert [len(pids[r]) for r in range(4)] == [2, 1, 1, 1], output  # only the killed rank got a new process
    assert re.search(r'"rank": 1, "generation": \d+, "role": "parked"', output), output  # admitted and healed
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), output
    assert losses[1] == {expected_losses[1]}, output  # before the failure: bitwise
    for iteration, (loss,) in losses.items():
        assert loss == pytest.approx(expected_losses[iteration], rel=LOSS_RTOL, abs=0), (iteration, output)
    valid = logged_losses(tmp_path, "valid_lm_loss")
    assert sorted(valid) == [4, 8], output  # the shrunk job evaluates too (iteration 4), on the same batch
    for iteration, values in valid.items():
        assert all(v == pytest.approx(expected_valid[iteration], rel=LOSS_RTOL, abs=0) for v in values), output
    # The save after iteration 4 came from the shrunk job (2 ranks write), the final one from the whole job.
    assert len([f for f in os.listdir(tmp_path / "iter_0000004") if f.endswith(".distcp")]) == 2, output
    final, expected = model_weights(str(tmp_path / f"iter_{ITERS:07d}")), model_weights(
        os.path.join(reference_dir, f"iter_{ITERS:07d}"))
    assert final.keys() == expected.keys()
    worst = max((final[k].float() - expected[k].float()).abs().max().item() for k in final)
    assert worst <= WEIGHT_ATOL, f"final weights differ by up to {worst}\n{output}"
    earlier = model_weights(os.path.join(reference_dir, "iter_0000004"))
    moved = max((final[k].float() - earlier[k].float()).abs().max().item() for k in final)
    assert moved > 100 * WEIGHT_ATOL, moved  # the tolerance is far below what 4 iterations change
