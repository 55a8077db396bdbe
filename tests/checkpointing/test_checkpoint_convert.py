"""tools/checkpoint_convert.py: torch <-> torch_dist both ways and plain weights, each resumable."""

import os
import subprocess
import sys

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_losses, tiny_pretrain_flags

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402

TOOL = os.path.join(REPO, "tools", "checkpoint_convert.py")
TINY = tiny_pretrain_flags(overlap_grad_reduce=True, ddp_bucket_size="2000")


_main = pretrain_losses  # pretrain_gpt.main on each rank: {iteration: lm loss}


def _convert(*argv):
    out = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_convert_both_ways_and_export_weights(tmp_path):
    """Would catch a conversion that drops optimizer moments, the step count, the schedule or the data
    position (the converted checkpoints must continue like the original), or exported weights that do not
    load into GPTModel with the trained values."""
    straight = run_distributed(_main, 2, TINY + ["--data-parallel-sharding-strategy", "optim"])[0]
    dist_dir, torch_dir, back_dir = (str(tmp_path / n) for n in ("dist", "torch", "back"))
    run_distributed(_main, 2, TINY + ["--data-parallel-sharding-strategy", "optim_grads_params", "--save", dist_dir,
                                      "--exit-interval", "3", "--ckpt-format", "torch_dist"])
    _convert("--input", dist_dir, "--output", torch_dir, "--to", "torch")
    _convert("--input", torch_dir, "--output", back_dir, "--to", "torch_dist",
             "--export-weights", str(tmp_path / "gpt.pt"))
    assert os.path.exists(os.path.join(torch_dir, "iter_0000003", "model_optim_rng.pt"))
    assert os.path.exists(os.path.join(back_dir, "iter_0000003", "common.pt"))
    for directory, world, strategy in [(torch_dir, 1, "no_shard"), (back_dir, 2, "optim")]:
        resumed = run_distributed(_main, world, TINY + ["--data-parallel-sharding-strategy", strategy,
                                                        "--load", directory])[0]
        for i in (4, 5, 6):
            assert abs(resumed[i] - straight[i]) <= 1e-5 * straight[i], (directory, i)

    from megatron_lite.models import GPTConfig, GPTModel

    weights = torch.load(tmp_path / "gpt.pt", weights_only=True)
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=384,
                               max_position_embeddings=32))
    model.load_state_dict(weights)  # strict: every key and shape
    saved = torch.load(os.path.join(torch_dir, "iter_0000003", "model_optim_rng.pt"), weights_only=True)["model"]
    assert all(torch.equal(weights[k], saved[k]) for k in saved)


def test_hf_export_refuses_a_non_empty_output_before_any_work(tmp_path, monkeypatch, capsys):
    """export_hf and `--to hf` refuse a non-empty --output, naming it, before the checkpoint is read, the
    tokenizer built or a tensor converted, and leave the directory as it was. Would catch the check made
    after the conversion (a large model read and converted, then refused), or files written into it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def conversion_work(*args, **kwargs):
        raise AssertionError("conversion work before the --output check")

    monkeypatch.setattr(checkpoint_convert.files, "find_latest", conversion_work)
    monkeypatch.setattr(checkpoint_convert, "read", conversion_work)
    monkeypatch.setattr(checkpoint_convert, "build_tokenizer", conversion_work)
    monkeypatch.setattr(checkpoint_convert.hf_convert, "to_hf", conversion_work)
    payload = {"model": {}, "iteration": 0, "args": {"tokenizer_type": "NullTokenizer", "vocab_size": 300}}
    with pytest.raises(ValueError, match=f"--output {out} is not empty"):
        checkpoint_convert.export_hf(payload, str(out))
    with pytest.raises(SystemExit):
        checkpoint_convert.main(["--input", str(tmp_path / "save"), "--to", "hf", "--output", str(out)])
    assert f"--output {out} is not empty" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_an_output_that_is_a_file_is_a_flag_error(tmp_path, capsys):
    """Would catch --output naming an existing file ending in a traceback (os.listdir's NotADirectoryError for
    --to hf, os.makedirs' FileExistsError for --from hf) instead of the tool's flag error, or the file
    overwritten."""
    out = tmp_path / "weights.bin"
    out.write_text("mine")
    with pytest.raises(ValueError, match=f"--output {out} is a file"):
        checkpoint_convert.export_hf({"model": {}, "iteration": 0, "args": {}}, str(out))
    for argv in (["--to", "hf"], ["--to", "torch_dist"], ["--from", "hf"]):
        with pytest.raises(SystemExit) as exc:
            checkpoint_convert.main(["--input", str(tmp_path / "save"), "--output", str(out)] + argv)
        assert exc.value.code == 2, argv
        assert f"--output {out} is a file, not a directory" in capsys.readouterr().err, argv
    assert out.read_text() == "mine"


@pytest.mark.parametrize("how", ["script from elsewhere", "module from the checkout"])
def test_the_tool_finds_hf_convert_however_it_is_run(tmp_path, how):
    """Would catch `import hf_convert` (tools/hf_convert.py, beside the tool) failing where tools/ is not
    sys.path[0]: `python -m tools.checkpoint_convert` from the checkout, as it ran before hf_convert moved out
    of megatron_lite/checkpointing/; and `python /abs/path/tools/checkpoint_convert.py` from any directory."""
    argv, cwd = (([TOOL], str(tmp_path)) if how == "script from elsewhere"
                 else (["-m", "tools.checkpoint_convert"], REPO))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120, cwd=cwd,
                         env=env)
    assert out.returncode == 0 and "--from {hf,megatron}" in out.stdout, out.stdout + out.stderr
