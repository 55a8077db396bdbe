"""Smoke test of benchmarks/zero3_scale.py: the meta build, sharded load and normally built run (build and the
same training) run end to end on 2 gloo ranks and every phase is reported next to theory (no memory or timing
thresholds: RSS depends on the machine)."""

import re
import subprocess
import sys

from pretrain_testing import REPO

PHASES = [("meta", "build"), ("meta", "first iteration"), ("meta", "steady state"), ("load", "load"),
          ("normal", "build"), ("normal", "first iteration"), ("normal", "steady state")]


def test_zero3_scale_quick_reports_every_phase_of_every_rank():
    """Catches a benchmark that fails to build on meta, save, load into a meta-built model or build and train
    normally at dp=2, a phase or a rank missing from the report, or a verdict line that is not printed."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.zero3_scale", "--quick",
                          "--world-size", "2"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    for run, phase in PHASES:
        line = re.search(rf"^\s+{run}\s+{phase}\s+peak per rank \(MiB\):\s+([\d.]+)\s+([\d.]+) \| theory\s+[\d.]+",
                         out.stdout, re.M)
        assert line, (run, phase, out.stdout)
        assert all(float(v) > 0 for v in line.groups()), line.group(0)
    assert "loss after loading" in out.stdout and "meta-built ZeRO-3: largest peak" in out.stdout
    assert "normally built, same training: peak per rank" in out.stdout


def test_sharded_peak_memory_reports_every_phase_of_every_system():
    """Catches benchmarks/sharded_peak_memory.py failing to build or train a system (megatron-lite's ZeRO-3,
    FSDP2) in freshly spawned ranks with the allocator's environment, or a phase missing from its table."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.sharded_peak_memory", "--size", "tiny",
                          "--world-size", "2", "--steps", "2", "--allocator", "mmap64k", "--systems", "ml-zero3,fsdp2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    for system in ("ml-zero3", "fsdp2"):
        row = re.search(rf"^\| mmap64k \| {system} \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", out.stdout, re.M)
        assert row and all(int(v) > 0 for v in row.groups()), (system, out.stdout)
