"""Smoke tests of benchmarks/compare_ddp.py, compare_ddp_zero3.py, muon_work.py and muon_step.py: they run end to
end and report complete results (no timing checks)."""

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


def test_compare_ddp_zero3_tiny_reports_every_setting():
    """Catches a ZeRO-3 setting that fails to build or step, losses that drift from torch DDP's, ZeRO-3
    communicating more than FSDP2 (the gloo reduce-scatter falling back to an all-reduce), and a
    max_reuse_distance that saves no gather."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_ddp_zero3", "--tiny"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 7 and cells[1][:1].isdigit():
            rows[cells[0]] = dict(comm=float(cells[3]), peak=cells[4])
    assert {"torch-ddp", "fsdp2", "ml-zero2", "ml-zero3", "zero3 prefetch 0", "zero3 persist 1e5",
            "zero3 reuse all"} <= set(rows), out.stdout
    assert "agree with torch-ddp within 0.0001: True" in out.stdout
    assert rows["ml-zero3"]["comm"] <= rows["fsdp2"]["comm"]
    assert rows["zero3 reuse all"]["comm"] < rows["ml-zero3"]["comm"]
    assert rows["ml-zero3"]["peak"] != "n/a" and rows["fsdp2"]["peak"] == "n/a"


def test_muon_work_counts_each_matrix_once_and_splits_the_work():
    """Catches Newton-Schulz work the code issues but the ownership does not predict (a QKV orthogonalized fused,
    an extra matmul per iteration), a matrix owned twice or by nobody (shares not summing to 1), and a balance
    worse than LPT's bound."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.muon_work", "--model", "tiny", "--dp", "1", "2", "4",
                          "--bucket-sizes", "0", "1000"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    work, exchange = {}, {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] == "tiny" and cells[2].isdigit():
            work.setdefault(int(cells[1]), []).append((float(cells[4]), float(cells[5]), float(cells[6])))
        if len(cells) == 7 and cells[0] == "tiny":
            exchange[(int(cells[1]), cells[2])] = float(cells[4])
    assert sorted(work) == [1, 2, 4] and all(len(rows) == dp for dp, rows in work.items()), out.stdout
    for dp, rows in work.items():
        assert all(predicted == counted for predicted, counted, _ in rows), rows
        assert abs(sum(share for _, _, share in rows) - 1) < 2e-3 and max(s for _, _, s in rows) < 4 / 3 / dp, rows
    assert set(exchange) == {(2, "one bucket"), (2, "1000"), (4, "one bucket"), (4, "1000")}
    assert all(0 < share <= 1 for share in exchange.values()), exchange


def test_muon_step_tiny_splits_the_work_and_agrees_with_torch(tmp_path):
    """Catches a system that fails to build or step with Muon on 2 gloo ranks, sharded Muon orthogonalizing a matrix
    on more than one rank (or on none: the work per rank must add up to torch's, which every rank does whole), and
    parameters that drift from torch DDP + torch.optim.Muon + AdamW on the same batches."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.muon_step", "--quick", "--out", str(tmp_path / "m.json")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "m.json") as f:
        result = json.load(f)
    assert result["systems"] == ["ml-zero1 muon", "ml-ddp muon", "torch-ddp muon"] and result["world_size"] == 2
    work = result["multiply_adds_per_rank"]  # [rank][system]
    assert [rank[2] for rank in work] == [rank[1] for rank in work] and work[0][2] > 0
    assert sum(rank[0] for rank in work) == work[0][2] and max(rank[0] for rank in work) < work[0][2], work
    assert max(result["drift"]) <= 1e-6, result["drift"]
    assert all(ms > 0 for ms in result["step_ms"] + result["optimizer_step_ms"])
