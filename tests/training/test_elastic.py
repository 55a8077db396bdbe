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
import time

import pytest
from distributed_helper import run_distributed
from live_testing import ITERS, PROGRESS_BOUNDED, logged_losses, run_live
from pretrain_testing import REPO

from megatron_lite.distributed.layout import default_bucket_size
from megatron_lite.fault_tolerance import launch, membership
from megatron_lite.fault_tolerance.elastic import check_elastic, generation_args

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402

LOSS_RTOL, WEIGHT_ATOL = 1e-6, 2e-5


def job_args(**overrides):
    values = dict(num_distributed_optimizer_instances=2, data_parallel_size=4, micro_batch_size=2,
                  global_batch_size=16, num_micro_batches=2, ddp_bucket_size=None, ddp_num_buckets=None)
    return argparse.Namespace(**{**values, **overrides})


def test_generation_args_of_a_shrunk_job():
    """Would catch a shrunk generation built with the whole job's data-parallel size, instances or micro-batches
    per rank (the global batch would no longer be the same samples), the job's arguments modified, or a bucket
    size that follows the smaller job's data-parallel size (every shard range would move: the carried state
    loaded into the wrong layout)."""
    args = job_args()
    assert generation_args(args, 4) is args
    smaller = generation_args(args, 2)
    assert (smaller.data_parallel_size, smaller.num_distributed_optimizer_instances, smaller.num_micro_batches) \
        == (2, 1, 4)
    assert (args.data_parallel_size, args.num_distributed_optimizer_instances, args.num_micro_batches) == (4, 2, 2)
    # Megatron's default bucket size grows with dp (max(40M, 1M x dp)): the smaller job keeps the whole job's,
    # so that its buckets, and so its shards, are cut the same.
    wide = generation_args(job_args(num_distributed_optimizer_instances=2, data_parallel_size=64, global_batch_size=128,
                                    micro_batch_size=1, num_micro_batches=2), 32)
    assert wide.ddp_bucket_size == default_bucket_size(64) != default_bucket_size(32)
    assert generation_args(job_args(ddp_bucket_size=1000), 2).ddp_bucket_size == 1000
    with pytest.raises(ValueError, match="whole instances"):
        generation_args(args, 3)


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


def test_check_elastic_accepts_exactly_the_jobs_every_generation_trains_the_global_batch():
    """Over small configurations (R instances of s ranks, micro-batch m, global batch g a multiple of the whole
    job's m x dp, --min-instances k): check_elastic accepts exactly when every generation it may shrink to,
    from k instances up, trains on all g samples per step (generation_args' micro-batches x m x dp == g).
    Would catch a check that skips a generation, the smallest (k instances) included: that job would train on
    fewer samples per step than the global batch (generation_args floors the micro-batches), or one that
    refuses a job that is fine."""
    for instances in range(2, 6):
        for per_instance in range(1, 4):
            for micro in (1, 2):
                dp = instances * per_instance
                for global_batch in range(micro * dp, 7 * micro * dp, micro * dp):
                    for minimum in range(1, instances + 1):
                        args = job_args(num_distributed_optimizer_instances=instances, data_parallel_size=dp,
                                        micro_batch_size=micro, global_batch_size=global_batch,
                                        num_micro_batches=global_batch // (micro * dp))
                        sizes = range(minimum * per_instance, dp + 1, per_instance)
                        trained = {size: generation_args(args, size).num_micro_batches * micro * size
                                   for size in sizes}
                        case = (instances, per_instance, micro, global_batch, minimum, trained)
                        try:
                            check_elastic(args, minimum)
                        except ValueError as e:
                            smallest_short = min(size for size, samples in trained.items() if samples != global_batch)
                            assert f"with {smallest_short // per_instance} of {instances}" in str(e), case
                        else:
                            assert all(samples == global_batch for samples in trained.values()), case
    # The smallest job alone falls short: 5 instances of 1 rank, micro-batch 1, global batch 20, at least 3
    # instances: 4 ranks train 20 samples, 3 ranks would train 18 (6 micro-batches of 1 on each).
    with pytest.raises(ValueError, match=re.escape("with 3 of 5 instances")):
        check_elastic(job_args(num_distributed_optimizer_instances=5, data_parallel_size=5, micro_batch_size=1,
                               global_batch_size=20, num_micro_batches=4), 3)


def model_weights(directory):
    return checkpoint_convert.read(directory)["model"]


@PROGRESS_BOUNDED
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor's workers are killed by signal")
def test_shrink_then_grow(tmp_path, live_reference):
    """Rank 0 is killed during iteration 2 and its replacement comes back only once iteration 4 is logged
    (--replacement-timeout 1): the job shrinks to instance {2, 3} (rank 2 becomes rank 0 of the smaller job:
    it logs and saves), rank 1 waits, alive, to be admitted; after iteration 5 ranks 2 and 3 wait until the
    supervisor grows the job, they leave together at its iteration boundary, and ranks 0 and 1 are healed from
    instance {2, 3}. Would catch: the survivors waiting for the replacement instead of shrinking, a shrunk job
    training on other samples or another batch size (the losses would differ far beyond an ulp), a healthy
    process restarted, a rank renumbered onto another shard position, a parked rank not admitted or not healed,
    the grow losing or repeating an iteration, a periodic save during the shrink missing, the --save lock not
    handed over (rank 2 takes it as the small job's rank 0, then the replaced rank 0 after the grow: a refusal)
    or left behind at the end."""
    reference_dir, expected_losses, expected_valid, _ = live_reference
    faults = "0:2:forward_backward:0;0:4:hold:new;2:5:grow:0;3:5:grow:0"
    code, pids, losses, output = run_live(tmp_path, faults, ["--spares", "0", "--min-instances", "1",
                                                             "--replacement-timeout", "1"])
    assert code == 0, output
    assert not os.path.exists(tmp_path / "job.lock"), output  # released by the last rank 0 at the end
    assert re.search(r"generation \d+: replaced \[\], members \[2, 3\] \(shrink: rank\(s\) \[0\]", output), output
    grow = re.search(r"generation (\d+): replaced \[\] \(grow: .* after iteration (\d+)\)", output)
    assert grow and grow.group(2) == "7", output  # rank 0 of the small job had logged 5 when it was asked
    leaves = re.findall(r"\[rank (\d)\] > leaving generation \d+ after iteration (\d+)", output)
    assert sorted(leaves) == [("2", "7"), ("3", "7")], output  # together, at the agreed boundary
    assert f"generation {int(grow.group(1)) - 1} failed" not in output, output  # a planned leave, no failure
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



# ---------------------------------------------------------------------------------------- the protocol, in process
def store_with(keys):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in keys.items():
        store.set(key, value)
    return store


@pytest.mark.parametrize("case", ["left_out", "admitted_at_the_end", "closed"])
def test_join_ends_without_waiting_out_the_deadline(case):
    """A rank left out of the newest generation when training ends, a rank admitted by a grow that the end of
    training overtook (its generation will never form: the members finished instead of leaving), and a rank of
    a generation the supervisor closed to shrink it. Would catch: ranks waiting --join-timeout and then forcing
    a whole-job restart of a finished run (exit 3, or 1 with no restart left), or training in a closed
    generation while the supervisor has moved on."""
    keys = {"generation": "1", "gen_1/members": "[0, 1, 2, 3]"}
    keys.update({"left_out": {"gen_1/members": "[2, 3]", "finished": "8"}, "admitted_at_the_end": {"finished": "8"},
                 "closed": {"gen_1/ready": "closed"}}[case])
    join_timeout_s = 120.0  # a join that waits it out takes this long; one that ends at once, store lookups
    rank = membership.Membership(store_with(keys), 0, 4, 1, membership.LiveConfig(3.0, join_timeout_s, 1))
    expected = membership.GenerationSuperseded if case == "closed" else membership.JobFinished
    started = time.monotonic()
    with pytest.raises(expected):
        rank.join()
    assert time.monotonic() - started < join_timeout_s / 2  # not 5 s: a loaded machine may take seconds


class _Process:
    def __init__(self, pid, alive=True):
        self.pid, self.alive = pid, alive

    def poll(self):
        return None if self.alive else -9

    def send_signal(self, signum):  # stop_all's SIGTERM and wait: the process is gone
        self.alive = False

    def wait(self, timeout=None):
        return -9


def supervisor(timeout_s=0.0):
    sup = launch.Supervisor(["unused.py"], 4, membership.LiveConfig(3.0, 30.0, 1), 20, 1, 2.0, spares=0,
                            replacement_timeout_s=timeout_s)
    sup.generation, sup.members = 1, [0, 1, 2, 3]
    sup.workers = {r: _Process(100 + r) for r in range(4)}
    sup.pending, sup.pending_since = {0: 100}, {0: time.monotonic() - 1}  # rank 0's replacement: not back
    sup.store.set("instance_size", "2")
    sup.store.set("gen_1/members", "[0, 1, 2, 3]")
    return sup


def test_supervisor_shrinks_only_a_generation_that_has_not_formed():
    """Would catch a shrink decided while the late replacement arrived and formed the generation anyway (the
    ranks would train in generation 1 with 4 ranks while the supervisor believes in [2, 3]: their later
    failures misread), a shrink before --replacement-timeout, or one that keeps the broken instance."""
    sup = supervisor(timeout_s=60.0)
    sup.tend_elastic()
    assert sup.generation == 1  # not yet: the timeout has not passed
    sup = supervisor()
    sup.store.set("gen_1/ready", "1")  # the last member arrived first
    sup.tend_elastic()
    assert sup.generation == 1
    sup = supervisor()
    sup.tend_elastic()
    assert sup.generation == 2 and sup.members == [2, 3] and sup.store.get("gen_1/ready") == b"closed"
    assert sup.store.get("gen_2/members") == b"[2, 3]"


def test_supervisor_does_not_shrink_a_starting_job():
    """Every rank of a starting job (the first generation, or a whole-job restart) is new and slow to start:
    would catch a shrink because one started more slowly than --replacement-timeout (on loaded cores every
    start would shrink, then grow)."""
    sup = supervisor()

    def spawn(rank):  # as Supervisor.spawn, without a process: started long ago, never ready
        sup.workers[rank] = _Process(200 + rank)
        sup.pending[rank] = 200 + rank
        sup.pending_since.setdefault(rank, time.monotonic() - 60)
    sup.spawn = spawn
    sup.start_all()
    for rank in (0, 1, 2):  # ready (as note_standby finds them); rank 3 still starting
        del sup.pending[rank]
        sup.pending_since.pop(rank, None)
    sup.tend_elastic()
    assert sup.generation == 2 and sup.members == [0, 1, 2, 3]  # the restart's generation, not shrunk


def _heal_without_state():
    import types

    from megatron_lite.fault_tolerance.healing import heal

    no_buffers = types.SimpleNamespace(model_chunks=[])  # what heal reads of an optimizer before the decision
    return heal(None, None, no_buffers, None)


def test_heal_without_any_state_says_start_afresh():
    """No rank of the generation holds any state (every process new: a start, a restart, or a death before
    any rank finished building): every rank gets None and starts as pretrain() does. Would catch a fallback
    to a whole-job restart there, or ranks deciding differently (a fresh rank loading --load while another
    heals: mismatched collectives)."""
    assert run_distributed(_heal_without_state, 2) == [None, None]


def test_supervisor_grows_back_but_not_after_the_end():
    """Would catch a grow opened after training finished (its members would wait for ranks that exited), or no
    grow when the left-out instance is whole again."""
    for finished in (False, True):
        sup = supervisor()
        sup.generation, sup.members = 2, [2, 3]
        sup.pending, sup.pending_since = {}, {}  # rank 0's replacement is ready
        sup.store.set("gen_2/ready", "1")
        sup.store.set("last_logged", "5")
        if finished:
            sup.store.set("finished", "8")
        sup.tend_elastic()
        assert (sup.generation, sup.members) == ((2, [2, 3]) if finished else (3, [0, 1, 2, 3]))
        if not finished:
            assert sup.store.get("gen_2/leave_at") == b"7"


def test_supervisor_gives_up_at_once_on_a_usage_error():
    """A rank exiting 2 (argparse: a misspelt flag) ends the job with code 2 after one start. Would catch the
    supervisor replacing it like a killed rank: the same error printed again for each of --max-replacements
    (20) new processes before it gave up with code 1."""
    sup = launch.Supervisor(["-c", "import sys; sys.exit(2)"], 2, membership.LiveConfig(3.0, 30.0, 1), 20, 1, 2.0,
                            spares=0)
    started = []
    spawn = sup.spawn
    sup.spawn = lambda rank: (started.append(rank), spawn(rank))
    assert sup.run() == 2
    assert sorted(started) == [0, 1]  # the first start of each rank only
