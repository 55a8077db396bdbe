"""pretrain_gpt.py misused: contradictory schedule and checkpoint-path flags refused at parse time, and
resumes that would silently do nothing or train something else than asked stopped on every rank with a message.

The parse-time tests need no process; the others run 2 gloo ranks of the tiny GPT for a few iterations."""

import os

import pytest
from distributed_helper import run_distributed
from pretrain_testing import REPO, flag_error, pretrain_outcome, tiny_pretrain_flags

from megatron_lite.training import parse_args

TINY = tiny_pretrain_flags(num_layers="1", global_batch_size="4", train_iters="4", log_interval="2")


def _corpus(tmp_path) -> str:
    """A dataset of 40 byte-level documents of 51 tokens (eod last) under tmp_path; returns its prefix."""
    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, 257) as builder:
        for _ in range(40):
            builder.add_document(rng.integers(0, 256, 50).tolist() + [256])
    return prefix


# ------------------------------------------------------------------------------------------ parse time
def test_lr_decay_iters_of_zero_is_a_flag_error(capsys):
    """Would catch --lr-decay-iters 0 accepted: the decay is then over before the first iteration and every
    iteration trains at --min-lr, silently (Megatron asserts lr_decay_steps > 0)."""
    message = flag_error(["--lr-decay-iters", "0"], capsys)
    assert "--lr-decay-iters" in message and "> 0" in message
    assert parse_args(["--lr-decay-iters", "1", "--lr-warmup-iters", "0"], world_size=2).lr_decay_iters == 1


@pytest.mark.parametrize("flag", ["--load", "--save", "--tensorboard-dir"])
def test_load_or_save_naming_a_file_is_a_flag_error(tmp_path, flag, capsys):
    """Would catch --load FILE treated as an empty directory (a run that meant to resume trains from scratch,
    exit 0), and --save FILE or --tensorboard-dir FILE failing only on rank 0 after start-up while the other
    ranks go on."""
    path = tmp_path / "not_a_directory"
    path.write_text("x")
    message = flag_error([flag, str(path)], capsys)
    assert f"{flag} {path}" in message and "not a directory" in message


def test_load_naming_one_checkpoint_is_a_flag_error(tmp_path, capsys):
    """--load SAVE/iter_0000004 (one checkpoint, not the directory that holds them). Would catch it read as a
    directory without checkpoints: the run trains from scratch with exit code 0 instead of resuming; or a
    directory of checkpoints refused because another tool left a manifest.json beside them."""
    checkpoint = tmp_path / "ck" / "iter_0000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    message = flag_error(["--load", str(checkpoint)], capsys)
    assert f"--load {tmp_path / 'ck'}" in message and "one checkpoint" in message
    # Checkpoints with another tool's manifest.json beside them: a directory of checkpoints, accepted.
    (tmp_path / "ck" / "manifest.json").write_text("{}")
    assert parse_args(["--load", str(tmp_path / "ck")], world_size=1).load == str(tmp_path / "ck")


def test_metrics_file_naming_a_directory_is_a_flag_error(tmp_path, capsys):
    """Would catch --metrics-file DIR failing only on rank 0 (the writer) once training starts."""
    message = flag_error(["--metrics-file", str(tmp_path)], capsys)
    assert f"--metrics-file {tmp_path}" in message and "is a directory" in message


@pytest.mark.parametrize("argv, message", [
    (["--async-save"], "--async-save needs --save"),
    (["--override-opt_param-scheduler"], "--override-opt_param-scheduler says how to resume: it needs --load"),
    (["--use-checkpoint-opt_param-scheduler"], "--use-checkpoint-opt_param-scheduler says how to resume: it needs"),
])
def test_checkpoint_flags_that_would_do_nothing_are_flag_errors(argv, message, capsys):
    """Would catch --async-save without --save, or a resume policy without --load, accepted and silently
    ignored (as --finetune without --load is refused: the user believes something happens that does not)."""
    assert message in flag_error(argv, capsys)
    assert parse_args(argv + ["--save", "s", "--load", "s"], world_size=2).save == "s"


def test_checkpoint_and_metrics_paths_that_do_not_exist_yet_are_accepted(tmp_path):
    """Would catch the path checks refusing the usual first run: --save DIR --load DIR before DIR exists, an
    empty --load directory, a metrics file still to be created."""
    new, empty = str(tmp_path / "new"), str(tmp_path)
    args = parse_args(["--save", new, "--load", new, "--metrics-file", str(tmp_path / "m" / "m.jsonl")], world_size=2)
    assert args.load == new and parse_args(["--load", empty], world_size=2).load == empty


# ------------------------------------------------------------------------------------------ resumes
def test_train_iters_below_the_checkpoint_is_an_error_on_every_rank(tmp_path):
    """A checkpoint at iteration 4 resumed with --train-iters 2 (the schedule kept by --lr-decay-iters 4). Would
    catch the run loading it, training nothing and exiting 0 without a word (a user who took --train-iters for
    the iterations still to do). --train-iters equal to the checkpoint's iteration (a finished job started
    again) stays a quiet no-op."""
    save = str(tmp_path / "ck")
    assert all(status == "ok" for status, _ in run_distributed(pretrain_outcome, 2, TINY + ["--save", save]))
    resume = TINY + ["--load", save, "--save", save, "--lr-decay-iters", "4"]
    for status, message in run_distributed(pretrain_outcome, 2, resume + ["--train-iters", "2"]):
        assert status == "error" and "--train-iters 2" in message and "iteration 4" in message, message
    printed = run_distributed(_stdout_of_main, 2, resume)[0]
    assert "nothing left to train (--train-iters)" in printed and "consumed samples:" not in printed  # no log line


def test_finetune_with_no_checkpoint_is_an_error_on_every_rank(tmp_path):
    """--finetune --load DIR where DIR holds no checkpoint (a typo, the wrong mount). Would catch the run
    fine-tuning randomly initialised weights to the end with exit code 0."""
    argv = TINY + ["--finetune", "--load", str(tmp_path / "pretrained"), "--save", str(tmp_path / "ft")]
    for status, message in run_distributed(pretrain_outcome, 2, argv):
        assert status == "error" and "--finetune" in message and "no checkpoint" in message, message
    assert not os.path.exists(tmp_path / "ft" / "iter_0000004")


def test_metrics_file_that_rank_0_cannot_open_stops_every_rank(tmp_path):
    """The metrics file's directory cannot be made (a file is in the way). Would catch rank 0 (the only
    writer) failing alone while the other ranks go on into the first iteration's collectives."""
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    argv = TINY + ["--metrics-file", str(blocker / "metrics.jsonl")]
    for status, message in run_distributed(pretrain_outcome, 2, argv):
        assert status == "error" and "--metrics-file" in message and str(blocker) in message, message


def test_data_loader_workers_leave_the_random_stream_alone():
    """--num-workers N: starting the DataLoader (at the start of training, after --load restored the RNG, and
    at every evaluation) must not draw from the process's torch generator. Would catch a resumed run with
    --num-workers and dropout whose dropout masks are shifted by one draw from the uninterrupted run's (the
    iterator is made after the RNG state is restored), so that the resume is not bit-exact."""
    import torch

    from megatron_lite.data.data_samplers import micro_batch_iterator

    dataset = [{"tokens": torch.full((4,), i)} for i in range(8)]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    batches = micro_batch_iterator(dataset, 2, 2, 0, 1, num_workers=1)
    assert next(batches)["tokens"][:, 0].tolist() == [2, 3]
    assert torch.equal(torch.get_rng_state(), before)


def test_load_of_a_tracker_without_its_checkpoints_is_an_error_on_every_rank(tmp_path):
    """--load DIR where DIR's latest_checkpointed_iteration.txt says 40 but the iter_* directories are gone
    (moved, deleted, a partial copy). Would catch the run training from scratch with exit code 0 and then
    overwriting the tracker with its own iteration (Megatron fails loading the iteration the tracker names)."""
    save = tmp_path / "ck"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("40\n")
    for status, message in run_distributed(pretrain_outcome, 2, TINY + ["--load", str(save), "--save", str(save)]):
        assert status == "error" and "latest_checkpointed_iteration.txt" in message, message
        assert "no complete checkpoint" in message
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "40\n"
    assert not any(name.startswith("iter_") for name in os.listdir(save))


def test_tokenizer_model_without_its_tokenizer_type_is_a_flag_error(tmp_path, capsys):
    """--tokenizer-model tokenizer.json without --tokenizer-type HuggingFaceTokenizer, in either command. Would
    catch the file silently ignored: tools/preprocess_data.py writing byte-level ids that a run with the HF
    tokenizer then trains on without any error (every id fits its larger vocabulary), or pretrain_gpt.py
    training a byte-level model on the HF ids."""
    import importlib.util

    model = str(tmp_path / "tokenizer.json")
    message = flag_error(["--tokenizer-model", model, "--mock-data"], capsys)
    assert "--tokenizer-model is read by --tokenizer-type" in message and "HuggingFaceTokenizer only" in message
    spec = importlib.util.spec_from_file_location("preprocess_data_misuse", os.path.join(REPO, "tools",
                                                                                        "preprocess_data.py"))
    preprocess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preprocess)
    text = tmp_path / "text.txt"
    text.write_text("a document\n")
    with pytest.raises(SystemExit) as exc:
        preprocess.main(["--input", str(text), "--output-prefix", str(tmp_path / "out"), "--tokenizer-model", model])
    assert exc.value.code == 2
    assert "HuggingFaceTokenizer only, not by ByteLevelTokenizer" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out.bin")


def test_resume_with_a_smaller_global_batch_that_runs_out_of_data_is_an_error_on_every_rank(tmp_path):
    """A run of 6 iterations of 16 samples saved at 5, resumed for 12 iterations of 8: the data holds whole
    epochs of the 96 samples asked for (120), but 80 + 7 x 8 = 136 are needed. Would catch the run training
    iterations 6..10 and then dying in the middle of an iteration with a bare StopIteration."""
    prefix = _corpus(tmp_path)
    save = str(tmp_path / "ck")
    flags = tiny_pretrain_flags(mock_data=None, data_path=prefix, split="1,0,0", global_batch_size="16",
                                data_cache_path=str(tmp_path / "cache"), save=save)
    assert all(status == "ok" for status, _ in run_distributed(pretrain_outcome, 2, flags + ["--exit-interval", "5"]))
    resumed = tiny_pretrain_flags(mock_data=None, data_path=prefix, split="1,0,0", global_batch_size="8",
                                  train_iters="12", data_cache_path=str(tmp_path / "cache"),
                                  load=save) + ["--override-opt_param-scheduler"]
    for status, message in run_distributed(pretrain_outcome, 2, resumed):
        assert status == "error" and "resuming at 80 consumed samples" in message, message
        assert "--global-batch-size (16" in message


def _stdout_of_main(argv):
    """pretrain_gpt.main on this rank; returns what it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain_outcome(argv)
    return out.getvalue()


def test_evaluation_asked_for_without_validation_data_is_announced(tmp_path):
    """--eval-iters 2 --eval-interval 2 with --split 1,0,0 (no validation documents). Would catch the
    evaluations being left out without a word: the run ends with exit code 0 and no validation loss, and the
    user does not learn why."""
    flags = tiny_pretrain_flags(mock_data=None, split="1,0,0", eval_iters="2", eval_interval="2", train_iters="2",
                                data_cache_path=str(tmp_path / "cache"), data_path=_corpus(tmp_path))
    printed = run_distributed(_stdout_of_main, 2, flags)[0]
    assert "> valid: none" in printed and "no evaluation despite --eval-iters 2" in printed, printed
    assert "validation loss" not in printed


def test_resume_with_another_tokenizer_is_an_error_on_every_rank(tmp_path):
    """A ByteLevelTokenizer checkpoint resumed with --tokenizer-type NullTokenizer --vocab-size 300 (the same
    padded vocabulary, 384). Would catch the resume continuing silently with the embedding rows meaning other
    tokens (Megatron's check_checkpoint_args compares tokenizer_type). --finetune, which may change the
    tokenizer on purpose, still loads."""
    save = str(tmp_path / "ck")
    first = run_distributed(pretrain_outcome, 2, TINY + ["--save", save, "--train-iters", "2"])
    assert all(status == "ok" for status, _ in first)
    other = TINY + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--load", save]
    for status, message in run_distributed(pretrain_outcome, 2, other):
        assert status == "error" and "tokenizer_type=ByteLevelTokenizer" in message, message
    assert [status for status, _ in run_distributed(pretrain_outcome, 2, other + ["--finetune"])] == ["ok", "ok"]


def test_data_check_on_resume_leaves_a_finished_run_alone():
    """check_train_data: a checkpoint at --train-iters (a finished job started again, e.g. requeued) with a
    smaller --global-batch-size than its run's has nothing left to train. Would catch the data check refusing it
    (its consumed samples exceed the data sized for this run) instead of the quiet 'nothing left to train'."""
    import argparse

    from megatron_lite.training.training import check_train_data

    args = argparse.Namespace(train_iters=4, global_batch_size=8)
    check_train_data(args, range(45), 4, 64)  # finished: no error
    with pytest.raises(ValueError, match="resuming at 48 consumed samples"):
        check_train_data(args, range(45), 3, 48)  # one iteration left: 56 samples needed


def test_live_loop_checks_the_data_on_resume(monkeypatch):
    """The live loop (fault_tolerance.launch) starting from --load with a smaller --global-batch-size than the
    checkpoint's run. Would catch it running iterations until a bare StopIteration, which the supervisor
    answers with whole-job restarts that train the same iterations again, instead of pretrain()'s start-up
    error."""
    import argparse

    from megatron_lite.fault_tolerance import live_training

    monkeypatch.setattr(live_training, "resume", lambda *a: (5, 80, {"path": "ck"}))
    args = argparse.Namespace(train_iters=12, global_batch_size=8)
    with pytest.raises(ValueError, match="resuming at 80 consumed samples"):
        live_training._start(args, None, None, None, range(120))
