"""The training loop never trains on, or saves, garbage: NaN losses stop every rank together naming the
rank, and a checkpoint with NaN/Inf in it is never written."""

import os

import pytest
import torch
from distributed_helper import run_distributed


def _nan_loss_worker():
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite.training import train_step
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank = dist.get_rank()
    model, ddp, opt = build(dict(), dict(lr=1e-3))  # no grad check: the loss check alone must catch it
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")

    def forward_step(data_iterator, model):
        def loss_func(output):
            loss = output.float().pow(2).mean() * (float("nan") if rank == 1 else 1.0)
            return loss, {"lm loss": loss.detach()}
        return model(next(data_iterator)), loss_func

    data = iter([torch.randn(4, 8, generator=torch.Generator().manual_seed(rank + 10 * i)) for i in range(4)])
    try:
        train_step(forward_step, data, ddp, opt, sched, num_micro_batches=2, check_for_nan_in_loss=True)
    except RuntimeError as e:
        return str(e), all(torch.isfinite(p).all() for p in model.parameters())
    return None, None


def test_nan_loss_on_one_rank_stops_every_rank_naming_it():
    """Would catch a NaN loss that only its own rank notices (the others hang in the next collective) or
    that nobody notices (the log shows nan, the run exits 0)."""
    for message, params_finite in run_distributed(_nan_loss_worker, 2):
        assert message is not None and "rank(s) [1]" in message and "not finite" in message
        assert params_finite  # stopped before the optimizer applied NaN gradients


def _greedy_forward_step_worker():
    from optim_testing import build

    from megatron_lite.training import train_step
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = build(dict(), dict(lr=1e-3))
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")

    def forward_step(data_iterator, model):  # two micro-batches per call: not Megatron's contract
        x = torch.cat([next(data_iterator), next(data_iterator)])
        return model(x), lambda output: (output.float().pow(2).mean(), {})

    data = iter([torch.randn(4, 8) for _ in range(8)])
    try:
        train_step(forward_step, data, ddp, opt, sched, num_micro_batches=2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_a_forward_step_reading_more_than_one_micro_batch_per_call_is_named():
    """train_step reads the iteration's micro-batches before the first forward and hands forward_step an
    iterator over exactly those. Would catch a forward_step that reads two per call (against Megatron's
    contract) ending the run with a bare StopIteration that names nothing."""
    for message in run_distributed(_greedy_forward_step_worker, 2):
        assert message is not None and message.startswith("RuntimeError: forward_step read more than the 2 "
                                                          "micro-batch(es) read for it"), message


def _corpus_with_one_foreign_id(tmp_path, flags):
    """A dataset of 15 documents of ids below 1000 where one token is 1023 (NullTokenizer --vocab-size 1000 pads
    its embedding to 1024 rows), placed so that the first micro-step whose samples hold it gives it to
    data-parallel rank 1 only; returns the prefix."""
    import numpy as np

    from megatron_lite.data import IndexedDatasetBuilder, build_datasets
    from megatron_lite.training import parse_args
    from megatron_lite.training.data_arguments import gpt_dataset_config_from_args, train_valid_test_num_samples

    def write(ids):
        with IndexedDatasetBuilder(prefix, 1024) as builder:
            for document in np.split(ids, 15):
                builder.add_document(document)

    prefix, ids = str(tmp_path / "corpus"), np.arange(915)  # every token unique: its value says where it is
    write(ids)
    args = parse_args(flags + ["--data-path", prefix], world_size=2)
    tokenizer = type("Tokenizer", (), {"eod": 999, "vocab_size": 1000})()
    train = build_datasets(gpt_dataset_config_from_args(args, tokenizer), train_valid_test_num_samples(args))[0]
    micro_step_of = {}  # token -> {ranks holding it} in the first micro-step that reads it
    for i in range(args.train_iters * args.global_batch_size):
        step, rank = divmod(i // args.micro_batch_size, 2)
        for token in set(train[i]["tokens"].tolist()) | set(train[i]["labels"].tolist()):
            if micro_step_of.setdefault(token, (step, set()))[0] == step:
                micro_step_of[token][1].add(rank)
    token = next(t for t, (step, ranks) in sorted(micro_step_of.items()) if step > 0 and ranks == {1})
    write(np.where(ids == token, 1023, ids))  # the same lengths: the same sample order
    return prefix


def test_a_token_id_beyond_the_vocabulary_on_one_rank_stops_every_rank(tmp_path):
    """NullTokenizer --vocab-size 1000 on data holding one id 1023, in data-parallel rank 1's micro-batch only.
    Would catch the id going unnoticed (below the padded vocabulary of 1024: the run trains on a padding row
    and exits 0), and the error raised on rank 1 alone while rank 0 goes on into the gradient reduction and dies
    there of a lost connection (here: the process-group timeout) instead of naming rank 1's error."""
    from pretrain_testing import pretrain_outcome, tiny_pretrain_flags

    flags = tiny_pretrain_flags(mock_data=None, tokenizer_type="NullTokenizer", vocab_size="1000", split="1,0,0",
                                data_cache_path=str(tmp_path / "cache"))
    prefix = _corpus_with_one_foreign_id(tmp_path, flags)
    (status0, message0), (status1, message1) = run_distributed(pretrain_outcome, 2, flags + ["--data-path", prefix])
    assert status1 == "error" and "token id 1023 is not in the tokenizer's vocabulary of 1000" in message1, message1
    assert message1.startswith(f"ValueError: {prefix}: ") and "sequence" in message1
    assert status0 == "error" and message0.startswith("RuntimeError: reading the data failed on data-parallel "
                                                      "rank(s) [1]: rank 1: ValueError: "), message0


def _nan_checkpoint_worker(root):
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-3, use_distributed_optimizer=True))
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("inf")
    try:
        checkpointing.save_checkpoint(root, 3, ddp, opt, sched, consumed_train_samples=8)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def test_checkpoint_with_nan_is_never_written(tmp_path):
    """Would catch a checkpoint that resumes a broken run (and, being the newest, shadows the good ones)."""
    for message in run_distributed(_nan_checkpoint_worker, 2, str(tmp_path)):
        assert message is not None and "fc2.weight" in message
    assert not any(name.startswith("iter_") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("argv, expected", [
    ([], True), (["--no-check-for-nan-in-loss-and-grad"], False), (["--fp16"], False),
    (["--fp16", "--loss-scale", "1024"], True), (["--bf16", "--loss-scale", "1024"], True),
])
def test_nan_check_is_megatrons_default(argv, expected):
    """On by default, off by itself only with dynamic fp16 loss scaling (allowed with a constant scale)."""
    from megatron_lite.training import parse_args

    assert parse_args(argv, world_size=1).check_for_nan_in_loss_and_grad is expected


def test_log_line_has_megatrons_bookkeeping(single_rank_group, capsys):
    """Megatron's log line: a timestamp, the loss averaged over the iterations that updated the model with a
    finite loss, and the numbers of skipped and of NaN iterations. Would catch a skipped (fp16 overflow) or
    NaN iteration dragging the logged loss."""
    import argparse
    import re

    from megatron_lite.training.metrics import TrainingLog

    args = argparse.Namespace(train_iters=4, log_interval=4, global_batch_size=2, seq_length=8, metrics_file=None,
                              tensorboard_dir=None)
    log = TrainingLog(args, torch.device("cpu"), 1, None)
    for iteration, loss, ok in [(1, 2.0, True), (2, 40.0, False), (3, float("nan"), True), (4, 6.0, True)]:
        log.training(iteration, 2 * iteration, {"lm loss": loss}, 1e-3, 1.0, 0.5 if ok else None, ok)
    line = capsys.readouterr().out.strip()
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        4/       4 \|", line), line
    assert "lm loss: 4.000000E+00 |" in line
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in line


def test_time_outside_training_is_left_out_of_ms_per_iteration(single_rank_group, capsys, monkeypatch):
    """A save or evaluation in the middle of a log interval pauses the interval's clock, as Megatron's
    'interval-time' timer does: the line divides the training time of all the interval's iterations by their
    number. Would catch the restart forgetting the iterations before the save (ms/iteration halved here), or
    counting the save."""
    import argparse
    import re

    from megatron_lite.training import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    args = argparse.Namespace(train_iters=8, log_interval=4, global_batch_size=2, seq_length=8, metrics_file=None,
                              tensorboard_dir=None)
    log = metrics.TrainingLog(args, torch.device("cpu"), 1, None)
    for iteration in range(1, 9):
        clock[0] += 0.010  # each iteration trains 10 ms
        log.training(iteration, 2 * iteration, {"lm loss": 1.0}, 1e-3, 1.0, 0.5, True)
        if iteration in (2, 5):
            clock[0] += 5.0  # a checkpoint save: not training time
            log.restart_timer()
    times = re.findall(r"elapsed time per iteration \(ms\): ([\d.]+) \|", capsys.readouterr().out)
    assert times == ["10.0", "10.0"], times


def test_an_untimed_iteration_is_logged_without_shrinking_ms_per_iteration(single_rank_group, capsys, monkeypatch):
    """Live recovery's catch-up logs an iteration the survivors computed in the failed generation, right after
    the new log is made. Would catch it counted as an iteration of ~0 ms: a line of it alone with a made-up
    time, throughput and MFU, or the next interval's ms/iteration understated by its share."""
    import argparse
    import re

    from megatron_lite.training import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    args = argparse.Namespace(train_iters=6, log_interval=2, global_batch_size=2, seq_length=8, metrics_file=None,
                              tensorboard_dir=None)
    log = metrics.TrainingLog(args, torch.device("cpu"), 1, None)
    log.training(2, 4, {"lm loss": 1.0}, 1e-3, 1.0, 0.5, True, timed=False)  # the catch-up, on a log boundary
    log.training(3, 6, {"lm loss": 1.0}, 1e-3, 1.0, 0.5, True, timed=False)  # ... or inside an interval
    for iteration in (4, 5, 6):
        clock[0] += 0.010
        log.training(iteration, 2 * iteration, {"lm loss": 1.0}, 1e-3, 1.0, 0.5, True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "iteration        2/" in lines[0] and "elapsed time" not in lines[0] and "lm loss" in lines[0], lines[0]
    times = [re.search(r"elapsed time per iteration \(ms\): ([\d.]+) \|", line).group(1) for line in lines[1:]]
    assert times == ["10.0", "10.0"], lines
