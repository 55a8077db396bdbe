"""Smoke tests of the one-rank GPT benchmarks that the GPU runs use (ddp_overhead_gpt.py, optimizer_offload.py,
step_phases.py), here at --quick sizes on the CPU: they run end to end and report every variant (no
timing checks)."""

import json
import subprocess
import sys

from pretrain_testing import REPO


def _run(tmp_path, module, *flags):
    out = tmp_path / f"{module}.json"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--quick", "--device", "cpu",
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_ddp_overhead_gpt_reports_bare_and_wrapped_variants(tmp_path):
    """Catches a variant that fails to build or step (e.g. the bf16-gradient wrapper) and a missing result."""
    result = _run(tmp_path, "ddp_overhead_gpt")
    assert set(result["median_ms"]) == {"bare", "bare + fp32 grads", "megatron_lite, no overlap",
                                        "megatron_lite, overlap", "megatron_lite, overlap, bf16 grads"}
    assert all(ms > 0 for ms in result["median_ms"].values())


def test_optimizer_offload_reports_every_fraction(tmp_path):
    """Catches an offload variant that fails to build or step, and a missing result. (On the CPU the host
    is the model's device, so where the state lives is checked by tests/cuda/test_cuda_offload.py.)"""
    result = _run(tmp_path, "optimizer_offload")
    assert set(result["median_ms"]) == {"on the device", "offload 1.0", "offload 0.5"}
    assert all(ms > 0 for ms in result["median_ms"].values())
    assert all(mb > 0 for mb in result["state_host_mb"].values())


def test_step_phases_reports_every_phase_and_the_operators(tmp_path):
    """Catches a phase left out of the split (the optimizer step, the grad sync) or a missing profile table."""
    result = _run(tmp_path, "step_phases", "--eager")
    assert list(result["medians_ms"]) == ["zero grads", "forward + backward", "finish_grad_sync", "optimizer.step"]
    assert all(ms >= 0 for ms in result["medians_ms"].values()) and result["medians_ms"]["forward + backward"] > 0
    assert "aten::mm" in result["profile"]
