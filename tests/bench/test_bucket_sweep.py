"""Smoke test of benchmarks/bucket_size_sweep.py: it runs end to end on 2 spawned gloo ranks and reports
every configuration. No timing assertions (the numbers are noise at this size)."""

import csv
import importlib.util
import os
import subprocess
import sys

from pretrain_testing import REPO


def test_quick_sweep_reports_every_bucket_size(tmp_path):
    """Catches a sweep that crashes (API drift in DDP/optimizer/model), hangs (ranks issuing different
    collectives), drops the bucket_size=1 or one-bucket end of the range, or forgets the recommendation."""
    plot = tmp_path / "plot.png"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # not torchrun
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # run in tmp_path
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bucket_size_sweep", "--quick", "--out", str(plot)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout

    with open(tmp_path / "plot.csv") as f:
        rows = list(csv.DictReader(f))
    configs = [r["config"] for r in rows]
    assert configs[0] == "1" and rows[0]["bucket_size"] == "1"
    assert int(rows[0]["num_buckets"]) > 1  # one parameter per bucket
    one_bucket = [r for r in rows if r["config"].startswith("one bucket")]
    assert len(one_bucket) == 1 and one_bucket[0]["num_buckets"] == "1"
    assert configs[-2:] == ["overlap off", "compute only"]
    sizes = [int(r["bucket_size"]) for r in rows if r["bucket_size"]]
    assert sizes == sorted(sizes) and len(sizes) >= 4  # 1, a geometric series, one bucket
    for r in rows:
        float(r["step_ms"]), float(r["exposed_comm_ms"]), float(r["finish_grad_sync_ms"])
        assert f"| {r['config']:>22} |" in out  # the printed table has the same rows

    assert "recommended bucket size:" in out
    recommended = int(out.split("recommended bucket size:")[1].split()[0])
    assert recommended in sizes
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.exists() and plot.stat().st_size > 0
