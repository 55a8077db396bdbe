"""Smoke test of benchmarks/compare_ddp.py: it runs end to end and writes complete results (no timing checks)."""

import csv
import importlib.util
import json
import subprocess
import sys

from pretrain_testing import REPO

SYSTEMS = {"ml-ddp", "ml-ddp+distopt", "ml-zero2", "ml-zero3", "torch-ddp", "torch-ddp+zero", "fsdp2"}


def test_compare_ddp_tiny_writes_all_systems_and_losses_agree(tmp_path):
    """Catches a system that fails to build or step on 2 gloo ranks, a broken CSV/JSON/plot writer, and a
    system whose losses drift from ml-ddp's (different weights, batches or hyperparameters)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_ddp", "--tiny", "--cpu",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=55, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "compare_ddp.csv", newline="") as f:
        rows = {row["system"]: row for row in csv.DictReader(f)}
    assert set(rows) == SYSTEMS
    assert all(row["losses_agree"] == "True" for row in rows.values())
    with open(tmp_path / "compare_ddp.json") as f:
        result = json.load(f)
    assert {s["system"] for s in result["systems"]} == SYSTEMS and result["losses_agree"] is True
    assert result["machine"]["world_size"] == 2 and result["machine"]["parameters"] > 0
    for s in result["systems"]:
        assert s["comm_bytes_per_rank_per_step"] > 0 and min(s["model_state_bytes_per_rank"]) > 0, s
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "compare_ddp.png").stat().st_size > 0
