"""Weak command-line input is a flag error at parse time: pretrain_gpt.py's numeric and data flags, and
tools/preprocess_data.py's inputs with no document."""

import importlib.util
import os
import subprocess
import sys

import pytest
from pretrain_testing import REPO, flag_error

from megatron_lite.data import split_documents
from megatron_lite.training import parse_args

PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")


# ------------------------------------------------------------------------------------------- pretrain_gpt.py
@pytest.mark.parametrize("split, valid", [
    ("abc", "numbers"),
    ("", "numbers"),
    ("1,x,1", "numbers"),
    ("1,1,1,1", "1 to 3 non-negative numbers"),
    ("-1,1", "1 to 3 non-negative numbers"),
    ("1,-1,0", "1 to 3 non-negative numbers"),
    ("1,nan", "1 to 3 non-negative numbers"),
    ("1,inf", "1 to 3 non-negative numbers"),
    ("0,0,0", "train weight must be positive"),
    ("0", "train weight must be positive"),
])
def test_bad_split_is_a_flag_error(split, valid, capsys):
    """Catches a --split that is accepted at parse time and fails only once the process group exists
    and the dataset is built (a traceback on every rank instead of a usage message)."""
    message = flag_error([f"--split={split}"], capsys)
    assert f"--split {split!r}" in message and valid in message


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1/1/1", "100", "9,1", "0.9, 0.1", "1,0,0"])
def test_accepted_splits_are_unchanged(split):
    """Catches the parse-time check rejecting a --split that the data code takes, or changing it."""
    args = parse_args(["--split", split], world_size=2)
    assert args.split == split
    assert split_documents(1000, args.split)[0].stop > 0


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "NullTokenizer", "--mock-data", "--vocab-size", "0"], "--vocab-size must be an integer >= 2"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data", "--vocab-size", "1"], "--vocab-size must be an integer >= 2"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data", "--vocab-size=-7"], "--vocab-size must be an integer >= 2"),
    (["--vocab-size", "0"], "--vocab-size must be an integer >= 2"),
    # Another tokenizer defines its own vocabulary: --vocab-size would be silently ignored.
    (["--vocab-size", "1000"], "--vocab-size sets the vocabulary of --tokenizer-type NullTokenizer only"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "t.json", "--vocab-size", "1000"],
     "HuggingFaceTokenizer defines its own"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data"], "needs --vocab-size"),
    # The built-in corpus is text, which NullTokenizer cannot tokenize.
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], "NullTokenizer cannot tokenize"),
])
def test_bad_vocab_size_is_a_flag_error(argv, message, capsys):
    """Catches --vocab-size 0 / 1 / negative reaching the tokenizer after start-up, and --vocab-size silently
    ignored (a model of another size than asked for) or NullTokenizer left to fail on the built-in corpus."""
    assert message in flag_error(argv, capsys)


@pytest.mark.parametrize("argv", [
    ["--tokenizer-type", "NullTokenizer", "--vocab-size", "2", "--mock-data"],
    ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50304", "--data-path", "PREFIX"],
])
def test_good_vocab_size_is_accepted(argv, tmp_path):
    """Catches the vocabulary checks rejecting NullTokenizer's valid uses."""
    prefix = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):  # --data-path's files must exist at parse time
        open(prefix + ext, "wb").close()
    argv = [prefix if a == "PREFIX" else a for a in argv]
    assert parse_args(argv, world_size=2).vocab_size == int(argv[3])


@pytest.mark.parametrize("flag", ["--seq-length", "--micro-batch-size", "--global-batch-size", "--train-iters",
                                  "--hidden-size", "--num-layers", "--num-attention-heads", "--eval-interval",
                                  "--log-interval", "--save-interval", "--exit-interval", "--ffn-hidden-size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_sizes_and_intervals_are_flag_errors(flag, value, capsys):
    """Catches a size or interval of 0 or below that fails late (a division by zero, an empty tensor) or
    runs silently wrong instead of naming the flag."""
    argv = [f"{flag}={value}"] + (["--save", "ck"] if flag == "--save-interval" else [])
    message = flag_error(argv, capsys)
    assert flag in message and ("> 0" in message or "positive" in message), message


@pytest.mark.parametrize("seed", ["-1", str(2 ** 64)])
def test_seed_out_of_range_is_a_flag_error(seed, capsys):
    """Catches a --seed that torch or numpy's shuffling rejects only after the process group exists."""
    assert "--seed must be an integer in [0, 2**64)" in flag_error([f"--seed={seed}"], capsys)



@pytest.mark.parametrize("flag", ["--ddp-prefetch-bucket-size", "--ddp-max-reuse-distance",
                                  "--ddp-param-persistence-threshold"])
def test_zero3_gather_flags_reach_the_config_and_need_zero3(flag, capsys):
    """Would catch a ZeRO-3 tunable flag that never reaches DistributedDataParallelConfig, or one that is
    silently ignored under a strategy that gathers nothing (it must name the flag and the strategy)."""
    from megatron_lite.training.arguments import ddp_config_from_args

    zero3 = ["--overlap-grad-reduce", "--data-parallel-sharding-strategy", "optim_grads_params"]
    config = ddp_config_from_args(parse_args(zero3 + [flag, "7"], world_size=2))
    assert getattr(config, flag[len("--ddp-"):].replace("-", "_")) == 7
    message = flag_error([flag, "7"], capsys)
    assert flag in message and "--data-parallel-sharding-strategy='optim_grads_params'" in message

def test_cli_flag_error_before_start_up(tmp_path):
    """Catches `python pretrain_gpt.py --split abc` getting past parsing (a traceback after start-up, or
    the built-in corpus built first) instead of argparse's usage error and exit code 2."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--split", "abc",
                          "--data-cache-path", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "error: --split 'abc'" in out.stderr
    assert not os.path.exists(tmp_path / "cache")


# ---------------------------------------------------------------------------------------- preprocess_data.py
def load_preprocess_module():
    spec = importlib.util.spec_from_file_location("preprocess_data_flags", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, content", [
    ("empty.txt", ""),
    ("blank.txt", "\n   \n\t\n\n"),
    ("empty.jsonl", ""),
    ("blank.jsonl", '\n{"text": ""}\n  \n{"text": "", "id": 2}\n'),
])
def test_preprocess_input_without_documents_is_an_error(tmp_path, capsys, name, content):
    """Catches an input with no document giving exit 0 and a 0-document dataset (which fails only later,
    in training), also beside a good input, and output files left behind by the failure."""
    good, empty = tmp_path / "good.txt", tmp_path / name
    good.write_text("a real document\n", encoding="utf-8")
    empty.write_text(content, encoding="utf-8")
    out_dir = tmp_path / "out"
    preprocess = load_preprocess_module()
    for inputs in ([str(empty)], [str(good), str(empty)]):
        with pytest.raises(SystemExit) as exc:
            preprocess.main(["--input", *inputs, "--output-prefix", str(out_dir / "corpus")])
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"--input {str(empty)!r}: no documents" in err and "Traceback" not in err
        assert not out_dir.exists() or not os.listdir(out_dir)
    preprocess.main(["--input", str(good), "--output-prefix", str(out_dir / "corpus")])  # the good one alone works
    assert sorted(os.listdir(out_dir)) == ["corpus.bin", "corpus.idx"]
