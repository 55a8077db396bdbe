"""The alpha-beta performance model (benchmarks/perf_model.py): known inputs give known predictions, and the
bucket-size CLI that uses it."""

import os
import re
import subprocess
import sys

import pytest
from pretrain_testing import REPO

from benchmarks import perf_model as pm


def test_collective_times():
    """Would catch a wrong latency or bandwidth term (Thakur et al.'s ring and tree formulas)."""
    link = pm.Link(alpha=1e-5, beta=1e-9)
    assert pm.collective_time("all_reduce", 1e6, 4, link) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 * 1e-9)
    assert pm.collective_time("all_reduce", 1e6, 4, link, "tree") == pytest.approx(4 * 1e-5 + 2 * 1e6 * 1e-9)
    assert pm.collective_time("reduce_scatter", 1e6, 4, link) == pytest.approx(3 * 1e-5 + 0.75 * 1e6 * 1e-9)
    assert pm.collective_time("all_reduce", 1e6, 1, link) == 0.0
    with pytest.raises(ValueError, match="no model for all_gather with algorithm 'tree'"):
        pm.collective_time("all_gather", 1e6, 4, link, "tree")
    network = pm.Link.from_network(latency_us=5, bandwidth_gbps=100)
    assert network.alpha == pytest.approx(5e-6) and network.beta == pytest.approx(8e-11)


def test_fit_recovers_alpha_and_beta():
    truth = pm.Link(alpha=2e-4, beta=1e-9)
    samples = [("all_reduce", n, p, pm.collective_time("all_reduce", n, p, truth))
               for n in (4e3, 6.5e4, 1e6, 1.6e7) for p in (2, 3)]
    fitted = pm.fit_link(samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6) and fitted.beta == pytest.approx(truth.beta, rel=1e-6)


def _timeline():
    # Registration order: parameter 0 (ready last in backward), parameter 1 (ready first).
    return pm.Timeline(forward=0.01, backward=0.03, optimizer=0.005, numels=[100, 100], ready=[0.02, 0.01])


def test_step_prediction_by_hand():
    """Two one-parameter buckets of 400 bytes at dp=2; with beta 1e-4 s/B each all-reduce takes 40 ms:
    the first starts at 10 ms (its gradient), ends at 50; the second starts then, ends at 90, 60 ms after
    backward's end at 30. Would catch buckets launched before their gradients, collectives overlapping
    each other, or serial and overlapped exposure mixed up."""
    link = pm.Link(alpha=0.0, beta=1e-4)
    two = pm.predict(_timeline(), 100, 2, link)
    assert two["buckets"] == 2 and two["exposed"] == pytest.approx(0.06) and two["step"] == pytest.approx(0.105)
    serial = pm.predict(_timeline(), 100, 2, link, overlap=0.0)
    assert serial["exposed"] == pytest.approx(0.08)  # both collectives in full
    one = pm.predict(_timeline(), None, 2, link)
    assert one["buckets"] == 1 and one["exposed"] == pytest.approx(0.02 + 0.08 - 0.03)
    fast = pm.predict(_timeline(), 100, 2, pm.Link(alpha=0.0, beta=1e-5))
    assert fast["exposed"] == pytest.approx(0.0) and fast["step"] == pytest.approx(0.045)  # hidden by backward
    zero1 = pm.predict(_timeline(), 100, 2, link, distributed_optimizer=True)  # padded buckets, + all-gather
    assert zero1["step"] > two["step"]


def test_fit_overlap_and_recommendation():
    link = pm.Link(alpha=1e-3, beta=1e-5)
    measured = {b: pm.predict(_timeline(), b, 2, link, overlap=0.3)["step"] for b in (100, 200)}
    assert pm.fit_overlap(_timeline(), link, measured, 2) == pytest.approx(0.3)
    best, table = pm.recommend(_timeline(), [100, 200], 2, pm.Link(alpha=0.0, beta=1e-4))
    assert table[100]["step"] < table[200]["step"] and best == 100  # two buckets overlap the second's wait
    best, _ = pm.recommend(_timeline(), [100, 200], 2, pm.Link(alpha=1.0, beta=0.0))
    assert best == 200  # latency-bound: one collective


def test_predict_cli():
    out = subprocess.run([sys.executable, "-m", "benchmarks.bucket_size_sweep", "--predict", "--dp", "64",
                          "--bandwidth-gbps", "200", "--latency-us", "3", "--compute-scale", "0.02"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"recommended bucket size: \d+ elements", out.stdout) and "dp=64, 200 Gb/s" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.bucket_size_sweep", "--predict", "--dp", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dp must be > 0" in bad.stderr


def test_validation_of_the_committed_calibration():
    """docs/bucket_size_tuning.md's claim: calibrated at dp=2, the model predicts the measured dp=3 and dp=4
    steps within 25%."""
    data = os.path.join(REPO, "docs", "data")
    out = subprocess.run([sys.executable, "-m", "benchmarks.perf_model_report", "--calibration",
                          os.path.join(data, "perf_model_dp2.json"), "--validate",
                          os.path.join(data, "perf_model_dp3.json"), os.path.join(data, "perf_model_dp4.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    worst = float(re.search(r"largest error at the predicted world sizes: (\d+)%", out.stdout).group(1))
    assert worst <= 25


def test_calibration_feeds_the_predictor(tmp_path):
    """The chain a cluster user runs: perf_model_calibrate.py (here: 2 gloo ranks, a tiny GPT, one round) writes
    a file that --predict takes. Would catch a calibration file the predictor cannot read."""
    out = tmp_path / "calibration.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.perf_model_calibrate", "--world-size", "2", "--cpu",
                          "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                          "--seq-length", "16", "--vocab-size", "128", "--steps", "1", "--repeats", "1",
                          "--reps", "1", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    pred = subprocess.run([sys.executable, "-m", "benchmarks.perf_model_report", "--predict", "--calibration", str(out),
                           "--dp", "16", "--bandwidth-gbps", "100", "--latency-us", "10"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert pred.returncode == 0 and "recommended bucket size" in pred.stdout, pred.stderr
