"""Elastic mode across nodes, end to end: the agents (agent.py, cluster.py) with --min-instances and no spare,
over pretrain_gpt.py (tests/support/live_worker.py: its faults) on loopback (one etcd member, LocalEtcd).

The harness is test_agent.py's (the `etcd` and `agents` fixtures, class Agents); the tolerances are
tests/training/test_elastic.py's (its docstring: a shrunk job trains the same samples at dp=2, only the order of
the gradient sums differs: losses within 1e-6 relative, weights within 2e-5 absolute).
"""

import os
import re
import sys

import pytest
from live_testing import FLAGS, ITERS, PROGRESS_BOUNDED, WORKER, logged_losses, uninterrupted
from pretrain_testing import REPO
from test_agent import agents, etcd  # noqa: F401 - the fixtures

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402

LOSS_RTOL, WEIGHT_ATOL = 1e-6, 2e-5  # tests/training/test_elastic.py's


def model_weights(directory):
    return checkpoint_convert.read(directory)["model"]


@PROGRESS_BOUNDED
def test_a_node_lost_without_a_spare_shrinks_the_job_and_its_return_grows_it(agents, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    """pretrain_gpt.py (the tiny GPT, dp=4, R=2: one instance per node) on agents a (leading, slots 0 and 1) and
    b (slots 2 and 3), no spare, --min-instances 1 --replacement-timeout 1. After iteration 2 node b is killed
    with its agent: the leader aborts the generation and, no spare registering within the timeout, shrinks the
    job to instance {0, 1}, which trains on (it evaluates and saves after iteration 4) and waits after iteration
    5 (live_worker's grow fault) for the grow. A fresh agent for node b registers: the left-out slots are placed
    on it, its new processes wait to be admitted, and the job grows back (no abort: a planned leave of ranks 0
    and 1 after iteration 7), heals slots 2 and 3 from instance {0, 1} and finishes. Every iteration logged once,
    the losses, validation losses and final weights those of the uninterrupted torchrun run within the elastic
    deviation; node a's ranks keep their processes; every agent left exits 0. Would catch the leader waiting for a
    spare instead of shrinking, a shrink that keeps the broken instance, a returning node not placed or not
    admitted (the job would finish shrunk, or hang), a grow that aborts the members or loses or repeats an
    iteration, or a healthy rank restarted."""
    reference_dir, live = tmp_path / "reference", tmp_path / "live"
    reference_dir.mkdir()
    live.mkdir()
    expected_losses, expected_valid, _ = uninterrupted(str(reference_dir))
    monkeypatch.setenv("LIVE_FAULTS", "0:5:grow:0;1:5:grow:0")  # the first processes of slots 0 and 1
    monkeypatch.setenv("LIVE_FAULTS_DIR", str(live))
    command = [WORKER, *FLAGS, "--save", str(live), "--load", str(live)]
    job = agents(2, 2, directory=live, command=command,
                 flags=["--heartbeat-timeout", "20", "--collective-timeout", "10", "--join-timeout", "60",
                        "--trouble-grace", "5", "--min-instances", "1", "--replacement-timeout", "1"])
    metrics = os.path.join(job.directory, "metrics.jsonl")
    job.start("a")  # registers first: node 1 of the job, slots 0 and 1, and (first to ask) the leader
    job.start("b")
    job.wait_making_progress(lambda: os.path.exists(metrics) and 2 in logged_losses(job.directory),
                             "iteration 2 was not logged", [metrics])
    assert "leading the job" in job.log("a") and job.node("b") == {job.placement()[2][0]}, job.logs()
    lost = job.placement()[2][0]
    job.kill("b")
    shrink = re.compile(r"generation (\d+): replaced \[\], members \[0, 1\], node\(s\) \['" + re.escape(lost)
                        + r"'\] lost and no spare within --replacement-timeout: shrink")
    job.wait_making_progress(lambda: shrink.search(job.log("a")) and 3 in logged_losses(job.directory),
                             "the job did not shrink to instance {0, 1} and train on", [metrics])
    assert f"node(s) ['{lost}'] lost (lease expired)" in job.log("a"), job.logs()

    killed_log = job.log("b")  # the fresh agent's start rewrites the file
    job.start("b")  # the node returns: a new incarnation, no slots yet
    job.wait_making_progress(lambda: all(p.poll() is not None for p in job.agents.values()), "the job did not end",
                             [metrics])
    output = job.logs()
    assert {name: p.returncode for name, p in job.agents.items()} == {"a": 0, "b": 0}, output
    leader = job.log("a")
    assert re.search(r"slot\(s\) \[2, 3\] placed on spare node\(s\) to be admitted \(elastic grow\)", leader), output
    grow = re.search(r"generation (\d+): replaced \[\] \(grow: .* after iteration (\d+)\)", leader)
    assert grow and grow.group(2) == "7", output  # the shrunk job had logged 5 when it was asked
    assert int(grow.group(1)) == int(shrink.search(leader).group(1)) + 1, output
    assert f"generation {int(grow.group(1)) - 1} failed" not in output, output  # a planned leave: no abort
    leaves = re.findall(r"\[rank (\d)\] > leaving generation \d+ after iteration (\d+)", leader)
    assert sorted(leaves) == [("0", "7"), ("1", "7")], output
    assert sorted(re.findall(r"rank (\d+): pid \d+ \(generation", leader)) == ["0", "1"], output  # never restarted
    assert sorted(re.findall(r"rank (\d+): pid \d+ \(generation", killed_log)) == ["2", "3"], output
    assert sorted(re.findall(r"rank (\d+): pid \d+ \(generation", job.log("b"))) == ["2", "3"], output
    healed = re.findall(r'\[rank (\d)\] > recovered into generation (\d+): \{"rank": \d, "generation": \d+, '
                        r'"role": "replacement"', job.log("b"))
    assert sorted(healed) == [("2", grow.group(1)), ("3", grow.group(1))], output  # admitted by the grow, healed

    losses = logged_losses(job.directory)
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(len(v) == 1 for v in losses.values()), output
    assert losses[1] == {expected_losses[1]} and losses[2] == {expected_losses[2]}, output  # before the loss
    for iteration, (loss,) in losses.items():
        assert loss == pytest.approx(expected_losses[iteration], rel=LOSS_RTOL, abs=0), (iteration, output)
    valid = logged_losses(job.directory, "valid_lm_loss")
    assert sorted(valid) == [4, 8], output  # the shrunk job evaluates too (iteration 4)
    for iteration, values in valid.items():
        assert all(v == pytest.approx(expected_valid[iteration], rel=LOSS_RTOL, abs=0) for v in values), output
    # The save after iteration 4 came from the shrunk job (2 ranks write), the final one from the whole job.
    assert len([f for f in os.listdir(live / "iter_0000004") if f.endswith(".distcp")]) == 2, output
    final = model_weights(str(live / f"iter_{ITERS:07d}"))
    expected = model_weights(str(reference_dir / f"iter_{ITERS:07d}"))
    assert final.keys() == expected.keys()
    worst = max((final[k].float() - expected[k].float()).abs().max().item() for k in final)
    assert worst <= WEIGHT_ATOL, f"final weights differ by up to {worst}\n{output}"
