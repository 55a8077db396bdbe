"""tools/plot_metrics.py: loss curves from --metrics-file records (megatron_lite/training/metrics.py's format),
several runs side by side, without TensorBoard. The picture needs matplotlib (skipped without it); reading the
records and the refusals do not."""

import importlib.util
import json
import os
import sys

import pytest
from pretrain_testing import REPO

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(REPO, "tools", "plot_metrics.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training(iteration, loss, lr=1e-3, grad_norm=0.5):
    """A training record as TrainingLog.training writes it."""
    return {"iteration": iteration, "consumed_samples": 16 * iteration, "lm_loss": loss, "lr": lr, "loss_scale": 1.0,
            "grad_norm": grad_norm, "skipped": False}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_reads_runs_with_and_without_validation_and_a_resume(tmp_path):
    """Catches: timing records taken for losses, a run without validation records refused or given a validation
    line, a null grad norm (skipped iteration) breaking the read, and a resume's repeated iterations plotted twice
    (a line going back in x): the last record of an iteration must win, and be counted."""
    tool = load_tool()
    plain = write_jsonl(tmp_path / "a.jsonl", [
        training(1, 5.9), training(2, 5.0), {"iteration": 2, "elapsed_ms_per_iteration": 150.0, "tokens_per_s": 1e4},
        training(3, 4.5, grad_norm=None), {"iteration": 3, "valid_lm_loss": 4.6, "valid_lm_loss_ppl": 99.5},
        training(4, 4.2)])
    # A resume from the checkpoint of iteration 2 after the run had written iterations 3 and 4: the file has both.
    resumed = write_jsonl(tmp_path / "b.jsonl", [
        training(1, 5.8), training(2, 5.1), training(3, 4.9), training(4, 4.7),
        training(3, 4.4), training(4, 4.1), training(5, 3.9)])

    a, b = tool.read_run(plain, "a"), tool.read_run(resumed, "b")
    assert a.losses == {"lm_loss": {1: 5.9, 2: 5.0, 3: 4.5, 4: 4.2}}
    assert a.valid == {"lm_loss": {3: 4.6}} and a.grad_norm[3] is None and a.repeated == 0
    assert b.losses == {"lm_loss": {1: 5.8, 2: 5.1, 3: 4.4, 4: 4.1, 5: 3.9}}  # the resumed run's values
    assert b.valid == {} and b.repeated == 2


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the bench / dev extra) is not installed")
def test_two_runs_side_by_side_write_a_png(tmp_path, capsys):
    """Catches a tool that crashes on two runs (one without validation, one resumed, extra panels), writes no
    picture, or hides that iterations were recorded twice."""
    tool = load_tool()
    a = write_jsonl(tmp_path / "a.jsonl", [training(i, 6.0 - 0.1 * i) for i in range(1, 21)]
                    + [{"iteration": 20, "valid_lm_loss": 4.1, "valid_lm_loss_ppl": 60.3}])
    b = write_jsonl(tmp_path / "b.jsonl", [training(i, 6.0 - 0.09 * i) for i in range(1, 16)]
                    + [training(i, 6.0 - 0.09 * i) for i in range(11, 21)])
    out = tmp_path / "plots" / "loss.png"
    tool.main([a, b, "--label", "zero-1", "--label", "resumed", "--lr", "--grad-norm", "--out", str(out)])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"{b}: 20 iterations, 0 validation point(s); 5 iteration(s) recorded more than once" in printed
    assert f"wrote {out}" in printed

    tool.main([a])  # default picture: next to the first file
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.parametrize("content, problem", [
    ("iteration,lm_loss\n1,5.9\n", ":1: not a JSON line"),
    (json.dumps({"iteration": 1, "consumed_samples": 16, "lm_loss": 5.9}) + "\n\n{oops\n", ":3: not a JSON line"),
    ("[1, 2]\n", ":1: a JSON list, not a metrics record"),
    ('{"lm_loss": 5.9}\n', ":1: a record without an integer 'iteration'"),
    ('{"iteration": 1, "tokens_per_s": 10.0}\n', ": no training record"),
    (b"\x00\x9f\xff binary\n", ":1: not UTF-8 text"),
])
def test_not_a_metrics_file_is_refused_naming_file_and_line(tmp_path, capsys, content, problem):
    """Catches a raw JSONDecodeError / UnicodeDecodeError traceback (or a silently empty plot) for a file that is
    not pretrain_gpt.py's JSONL, instead of an error line naming the file and line."""
    tool = load_tool()
    path = tmp_path / "a.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as exit_info:
        tool.main([str(path), "--out", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert f"error: {path}{problem}" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_labels_and_missing_matplotlib_are_errors(tmp_path, capsys, monkeypatch):
    """Catches --label counts that do not match the files (labels silently shifted onto the wrong runs), labels
    that cannot tell runs apart (every run's file is metrics.jsonl), and an ImportError traceback where the
    missing extra should be named."""
    tool = load_tool()
    assert tool.labels_for(["x/a.jsonl", "y/b.jsonl"], None) == ["a", "b"]
    assert tool.labels_for(["x/metrics.jsonl", "y/metrics.jsonl"], None) == ["x/metrics.jsonl", "y/metrics.jsonl"]
    a = write_jsonl(tmp_path / "a.jsonl", [training(1, 5.9)])
    with pytest.raises(SystemExit):
        tool.main([a, a, "--label", "only one"])
    assert "--label given 1 times for 2 files" in capsys.readouterr().err

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit):
        tool.main([a, "--out", str(tmp_path / "x.png")])
    assert 'needs matplotlib, the optional \'bench\' extra: pip install -e ".[bench]"' in capsys.readouterr().err
