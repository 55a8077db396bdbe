"""Smoke test of benchmarks/compare_gloo_paths.py: ZeRO-3 and ZeRO-2 with gloo's broadcast paths and with the
calls they replaced train identically (no timing thresholds: they depend on the machine)."""

import subprocess
import sys

from pretrain_testing import REPO


def test_old_and_new_gloo_paths_give_identical_losses():
    """Catches a broadcast all-gather or two-broadcast reduce-scatter that changes any value (a piece from the
    wrong rank, a sum in another order), or a benchmark that no longer swaps the paths or reports a system."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.compare_gloo_paths", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "losses identical, old vs new paths: ZeRO-3 True, ZeRO-2 True" in out.stdout, out.stdout
    for name in ("ZeRO-3 broadcasts", "ZeRO-3 old paths", "ZeRO-2 broadcasts", "ZeRO-2 old paths", "torch-ddp"):
        assert name in out.stdout, out.stdout
