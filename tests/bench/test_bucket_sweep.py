"""benchmarks/bucket_size_sweep.py: a smoke run end to end on 2 spawned gloo ranks (every configuration reported,
progress printed, files in a new results directory), and the rows' arithmetic on made-up samples. No timing
assertions (the numbers are noise at this size)."""

import csv
import importlib.util
import os
import subprocess
import sys

import torch
from pretrain_testing import REPO

from benchmarks.bucket_size_sweep_report import summarize


def test_quick_sweep_reports_every_bucket_size(tmp_path):
    """Catches a sweep that crashes (API drift in DDP/optimizer/model), hangs (ranks issuing different
    collectives), drops the bucket_size=1 or one-bucket end of the range, or forgets the recommendation; and
    (issue 32) one that is silent while it measures, or writes by default where a committed file lies
    (docs/img/bucket_size_sweep.png and .csv, relative to the current directory) instead of a new directory
    under benchmarks/results/."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # not torchrun
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # run in tmp_path
    # The bound only keeps a hang from blocking the suite: the quick run takes seconds, start-up aside.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bucket_size_sweep", "--quick"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout

    assert not (tmp_path / "docs").exists(), "the default output must not be docs/img"
    runs = list((tmp_path / "benchmarks" / "results").iterdir())
    assert len(runs) == 1 and runs[0].is_dir(), runs
    table = runs[0] / "bucket_size_sweep.csv"
    assert f"table: {os.path.relpath(table, tmp_path)}" in out

    progress = [line for line in out.splitlines() if line.startswith("bucket_size_sweep: ") and " steps, " in line]
    assert progress and "left" in progress[0], out
    total = int(progress[0].split("/")[1].split()[0])
    assert progress[-1].startswith(f"bucket_size_sweep: {total}/{total} steps"), progress  # the last one is printed

    with open(table) as f:
        rows = list(csv.DictReader(f))
    configs = [r["config"] for r in rows]
    assert total == len(configs) * (1 + 2)  # --quick: one warm-up round, one round of two steps
    assert configs[0] == "1" and rows[0]["bucket_size"] == "1"
    assert int(rows[0]["num_buckets"]) > 1  # one parameter per bucket
    one_bucket = [r for r in rows if r["config"].startswith("one bucket")]
    assert len(one_bucket) == 1 and one_bucket[0]["num_buckets"] == "1"
    assert configs[-2:] == ["overlap off", "compute only"]
    sizes = [int(r["bucket_size"]) for r in rows if r["bucket_size"]]
    assert sizes == sorted(sizes) and len(sizes) >= 4  # 1, a geometric series, one bucket
    for r in rows:
        float(r["step_ms"]), float(r["finish_grad_sync_ms"]), float(r["step_minus_compute_only_ms"])
        assert float(r["exposed_comm_ms"]) >= 0 and float(r["param_gather_ms"]) == 0  # fp32 optimizer: no gather
        assert f"| {r['config']:>22} |" in out  # the printed table has the same rows

    assert "recommended bucket size:" in out
    recommended = int(out.split("recommended bucket size:")[1].split()[0])
    assert recommended in sizes
    if importlib.util.find_spec("matplotlib") is not None:
        plot = runs[0] / "bucket_size_sweep.png"
        assert plot.exists() and plot.stat().st_size > 0


def test_exposed_comm_is_the_measured_wait_never_negative():
    """Exposed communication was step - compute-only step, two medians of different configurations: negative
    whenever the noise was larger than the communication (and with the distributed optimizer, whose compute-only
    reference updates every parameter at dp=1). Catches a return to that difference: here the bucketed
    configuration's steps are faster than compute only's, and its exposed communication must still be its
    measured wait (finish_grad_sync + parameter all-gather), with the signed difference kept apart."""
    # [configuration, sample, (step, finish_grad_sync, param all-gather, their sum)] in seconds
    samples = torch.tensor([[[0.100, 0.004, 0.002, 0.006], [0.110, 0.006, 0.002, 0.008], [0.090, 0.005, 0.002, 0.007]],
                            [[0.120, 0.001, 0.000, 0.001], [0.105, 0.001, 0.000, 0.001], [0.112, 0.001, 0.000, 0.001]]],
                           dtype=torch.float64)
    rows = summarize(["65536", "compute only"], [65536, None], [2, 1], samples)
    bucketed, compute = rows
    assert bucketed["step_ms"] < compute["step_ms"]  # the noise the old difference turned into a negative value
    assert abs(bucketed["exposed_comm_ms"] - 7.0) < 1e-9 and abs(bucketed["param_gather_ms"] - 2.0) < 1e-9
    assert abs(bucketed["finish_grad_sync_ms"] - 5.0) < 1e-9
    assert abs(bucketed["step_minus_compute_only_ms"] - (100.0 - 112.0)) < 1e-9  # signed, in the CSV only
    assert compute["bucket_size"] == "" and compute["exposed_comm_ms"] == 1.0
    assert all(r["exposed_comm_ms"] >= 0 for r in rows)
