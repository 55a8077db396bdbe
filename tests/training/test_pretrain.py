"""pretrain_gpt.py end to end: flags, learning on real text, exact resume, resharding, crash-safe saves."""

import json
import os
import subprocess
import sys

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, tiny_pretrain_flags

# real text (no --mock-data), trained until each test's --train-iters; a wider model, a warmup, eval once
TINY = tiny_pretrain_flags(mock_data=None, train_iters=None, hidden_size="64", num_attention_heads="4", seq_length="64",
                           log_interval="4", eval_iters="1", lr="3e-3", min_lr="3e-4", lr_warmup_iters="2",
                           eval_interval="1000")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


def _pretrain_worker(argv):
    """pretrain_gpt.main on this rank of the pool; returns {iteration: lm loss}."""
    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    result = pretrain_gpt.main(argv, world_size=dist.get_world_size())
    return {iteration: reported["lm loss"] for iteration, reported in result["losses"].items()}


def _model_state(save_dir):
    """The newest checkpoint's state in the `torch` format's layout, whichever format wrote it."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    return iteration, checkpoint_convert.read(os.path.join(save_dir, f"iter_{iteration:07d}"))


def test_loss_falls_on_real_text_with_overlap_and_distributed_optimizer(data_cache, tmp_path):
    """Would catch a training loop that does not learn (wrong labels shift, grads not applied, data
    shuffled into noise) with the full overlapped ZeRO-1 path on 2 ranks."""
    argv = TINY + ["--train-iters", "40", "--overlap-grad-reduce", "--use-distributed-optimizer",
                   "--overlap-param-gather", "--ddp-bucket-size", "20000", "--data-cache-path", data_cache,
                   "--metrics-file", str(tmp_path / "m.jsonl")]
    losses = run_distributed(_pretrain_worker, 2, argv)[0]
    first = sum(losses[i] for i in range(1, 6)) / 5
    last = sum(losses[i] for i in range(36, 41)) / 5
    assert last < first - 1.0, (first, last)  # bytes: from ~ln(257) down by well over a nat
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["lm_loss"] for r in records if "lm_loss" in r] == [losses[i] for i in range(1, 41)]


def test_resume_is_bit_exact(data_cache, tmp_path):
    """N straight vs N/2 + save + load + N/2: identical losses and parameters (fp32, CPU). Would catch
    any state not checkpointed: optimizer moments or step, LR schedule, data position, RNG."""
    common = TINY + ["--train-iters", "8", "--overlap-grad-reduce", "--use-distributed-optimizer",
                     "--ddp-bucket-size", "20000", "--data-cache-path", data_cache, "--hidden-dropout", "0.1"]
    straight = run_distributed(_pretrain_worker, 2, common + ["--save", str(tmp_path / "a")])[0]
    first = run_distributed(_pretrain_worker, 2, common + ["--save", str(tmp_path / "b"), "--exit-interval", "4"])[0]
    resume_flags = ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]
    second = run_distributed(_pretrain_worker, 2, common + resume_flags)[0]
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    assert [first[i] for i in range(1, 5)] + [second[i] for i in range(5, 9)] == [straight[i] for i in range(1, 9)]
    (it_a, a), (it_b, b) = _model_state(tmp_path / "a"), _model_state(tmp_path / "b")
    assert it_a == it_b == 8
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["optimizer"]["state"][n]["exp_avg_sq"], b["optimizer"]["state"][n]["exp_avg_sq"])
               for n in a["optimizer"]["state"])


def test_resume_on_a_different_number_of_ranks(data_cache, tmp_path):
    """Saved on 2 ranks with the distributed optimizer, resumed on 1 rank without it: the same global
    batches continue; losses agree to rounding (the gradient sums are ordered differently)."""
    common = TINY + ["--train-iters", "8", "--data-cache-path", data_cache]
    straight = run_distributed(_pretrain_worker, 2, common + ["--use-distributed-optimizer"])[0]
    run_distributed(_pretrain_worker, 2, common + ["--use-distributed-optimizer", "--save", str(tmp_path / "c"),
                                                   "--exit-interval", "4"])
    resumed = run_distributed(_pretrain_worker, 1, common + ["--load", str(tmp_path / "c")])[0]
    assert sorted(resumed) == [5, 6, 7, 8]
    for i in range(5, 9):
        assert abs(resumed[i] - straight[i]) <= 1e-4 * straight[i], (i, resumed[i], straight[i])


def _save_with_crash_worker(root):
    from ddp_testing import make_model
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import torch_format
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-3, use_distributed_optimizer=True))
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, 1, 10, "cosine")
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, consumed_train_samples=8)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_save = torch.save

    def crashing_save(obj, f):
        real_save(obj, f)
        f.truncate(f.tell() // 2)  # half-written file, then the "crash"
        raise OSError("disk full (simulated)")

    torch_format._serialize = crashing_save
    try:
        checkpointing.save_checkpoint(root, 2, ddp, opt, sched, consumed_train_samples=16)
    except OSError as e:
        crashed = str(e)
    finally:
        torch_format._serialize = real_save
    # The previous checkpoint is still the latest and loads into a fresh model.
    fresh_model, fresh_ddp, fresh_opt = build(dict(use_distributed_optimizer=True),
                                              dict(lr=1e-3, use_distributed_optimizer=True), model=make_model(seed=5))
    fresh_sched = OptimizerParamScheduler(fresh_opt, 1e-3, 1e-4, 1, 10, "cosine")
    loaded = checkpointing.load_checkpoint(root, fresh_ddp, fresh_opt, fresh_sched)
    restored = all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), saved))
    return crashed, loaded["iteration"], loaded["consumed_train_samples"], restored, sorted(os.listdir(root))


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    """Would catch a save that writes in place (a crash destroys the only checkpoint) or moves `latest`
    before the new checkpoint is complete."""
    crashed, iteration, consumed, restored, listing = run_distributed(_save_with_crash_worker, 1, str(tmp_path))[0]
    assert "simulated" in crashed
    assert (iteration, consumed) == (1, 8) and restored
    assert listing == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # no partial leftovers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--global-batch-size", "10", "--micro-batch-size", "4"], "not divisible"),
        (["--fp16", "--bf16"], "mutually exclusive"),
        (["--overlap-param-gather"], "--use-distributed-optimizer"),
        (["--hidden-size", "100", "--num-attention-heads", "3"], "divisible"),
        (["--seq-length", "256", "--max-position-embeddings", "128"], "max-position-embeddings"),
        (["--mock-data", "--data-path", "x"], "mutually exclusive"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "min-lr"),
        (["--loss-scale", "128"], "--fp16"),
        (["--save-interval", "10"], "--save"),
        (["--ddp-bucket-size", "0"], "ddp-bucket-size"),
        (["--lr-decay-style", "exponential"], "invalid choice"),
        (["--lr-warmup-iters", "300"], "--lr-warmup-iters"),
        (["--fp16", "--check-for-nan-in-loss-and-grad"], "--check-for-nan-in-loss-and-grad"),
        (["--num-layers", "0"], "--num-layers"),
        (["--adam-beta1", "1.0"], "--adam-beta1"),
        (["--hidden-dropout", "1.0"], "--hidden-dropout"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
        (["--calculate-per-token-loss", "--ddp-average-in-collective"], "--ddp-average-in-collective"),
        (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], "mutually exclusive"),
        (["--exit-on-missing-checkpoint"], "--load"),
        (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction"),
        (["--tokenizer-type", "NullTokenizer"], "--vocab-size"),
    ],
)
def test_bad_flags_fail_at_start_up(argv, message, capsys):
    from megatron_lite.training import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=2)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_scheduler_shape():
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    class Opt:
        param_groups = [{"lr": None}, {"lr": None, "lr_mult": 0.5}]

    s = OptimizerParamScheduler(Opt, max_lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_steps=14,
                                lr_decay_style="cosine")
    lrs = []
    for _ in range(16):
        lrs.append(Opt.param_groups[0]["lr"])
        s.step()
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert abs(lrs[9] - (0.1 + 0.9 * 0.5)) < 1e-12  # half-way through the cosine
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == 0.1
    assert Opt.param_groups[1]["lr"] == 0.05
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerParamScheduler(Opt, 1.0, 0.1, 1, 2, "step")


def test_cli_under_torchrun_and_flag_error(tmp_path):
    """The README's entry point: torchrun + pretrain_gpt.py prints Megatron's log line; a bad flag exits 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "pretrain_gpt.py"), "--mock-data", "--train-iters", "4", "--log-interval", "2",
           "--eval-interval", "4", "--eval-iters", "1", "--num-layers", "1", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "32", "--save", str(tmp_path / "ck")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    report = f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, report
    assert "iteration        4/       4 | consumed samples:" in out.stdout, report
    assert "lm loss:" in out.stdout and "validation loss at iteration 4" in out.stdout, report
    assert os.path.exists(tmp_path / "ck" / "iter_0000004" / "manifest.json")  # complete (torch_dist, the default)
    assert os.path.exists(tmp_path / "ck" / "iter_0000004" / "common.pt")
    bad = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--fp16", "--bf16"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert bad.returncode == 2 and "mutually exclusive" in bad.stderr, bad.stderr[-3000:]


def test_help_renders():
    """Would catch a help string argparse cannot format (e.g. a bare '%'): --help must always work."""
    from megatron_lite.training import build_parser

    text = build_parser().format_help()
    assert "--overlap-grad-reduce" in text and "--use-distributed-optimizer" in text


def test_config_flags_are_generated_from_the_configs():
    """Every config field with a flag: help text = the field's docstring, and the parsed value reaches the
    config. Would catch a flag that is parsed but never mapped, or whose help drifted from the config."""
    from megatron_lite.models import GPTConfig
    from megatron_lite.training import arguments as a

    values = {"--ddp-bucket-size": "12345", "--num-distributed-optimizer-instances": "1",
              "--data-parallel-sharding-strategy": "optim_grads_params", "--lr": "0.25", "--min-lr": "0.125",
              "--ddp-prefetch-bucket-size": "4096", "--ddp-max-reuse-distance": "8192",
              "--ddp-param-persistence-threshold": "100",
              "--weight-decay": "0.5",
              "--clip-grad": "2.5", "--adam-beta1": "0.5", "--adam-beta2": "0.75", "--adam-eps": "0.001",
              "--sgd-momentum": "0.25", "--initial-loss-scale": "64", "--min-loss-scale": "2",
              "--loss-scale-window": "7", "--hysteresis": "3", "--loss-scale": "8", "--optimizer": "sgd",
              "--num-layers": "3", "--hidden-size": "48", "--num-attention-heads": "6", "--ffn-hidden-size": "40",
              "--max-position-embeddings": "256", "--hidden-dropout": "0.25", "--attention-dropout": "0.125",
              "--init-method-std": "0.5", "--optimizer-offload-fraction": "0.5", "--normalization": "RMSNorm",
              "--num-query-groups": "2", "--norm-epsilon": "0.001", "--rotary-base": "500000.0"}
    switches = ["--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer",
                "--ddp-average-in-collective", "--accumulate-allreduce-grads-in-fp32", "--fp16",
                "--optimizer-cpu-offload", "--swiglu", "--group-query-attention", "--disable-bias-linear"]
    argv = [x for flag, value in values.items() for x in (flag, value)] + switches + [
        "--no-check-for-nan-in-loss-and-grad"]  # on by default (Megatron's): its switch is the opt-out
    args = a.parse_args(argv, world_size=1)
    configs = [(a.ddp_config_from_args(args), a.DDP_FLAGS), (a.optimizer_config_from_args(args), a.OPTIMIZER_FLAGS),
               (a.gpt_config_from_args(args, vocab_size=64), a.GPT_FLAGS)]
    help_text = " ".join(build_parser_help().split())
    for config, flags in configs:
        docs = a.field_docs(type(config))
        for field, flag in flags.items():
            value = getattr(config, field)
            if flag == "--ddp-num-buckets":  # excludes --ddp-bucket-size: checked on its own below
                assert value is None
            else:
                expected = flag in switches if isinstance(value, bool) else type(value)(values[flag])
                assert getattr(config, field) == expected, (field, flag)
            assert docs[field][:40] in help_text, (field, docs[field])
    assert isinstance(configs[2][0], GPTConfig) and configs[1][0].params_dtype == torch.float16
    # Mapped by hand: --swiglu's activation and --disable-bias-linear's inverted field.
    assert (configs[2][0].activation_func, configs[2][0].add_bias_linear) == ("silu", False)
    argv = [x if x != "--ddp-bucket-size" else "--ddp-num-buckets" for x in argv]
    assert a.ddp_config_from_args(a.parse_args(argv, world_size=1)).num_buckets == 12345


def build_parser_help():
    from megatron_lite.training import build_parser

    return build_parser().format_help()


def test_preset_start_up_line_pastes_back_as_flags(single_rank_group, capsys):
    """The line '> --model-preset llama-tiny set the flags not given: ...', pasted after `--model-preset none`,
    gives the run the same values. Would catch switches printed as '--swiglu True' (argparse: unrecognized
    arguments: True) and values that do not parse back."""
    import shlex

    from megatron_lite.training import parse_args

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    argv = ["--mock-data", "--model-preset", "llama-tiny", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--eval-iters", "0", "--num-layers", "1", "--hidden-size", "32"]
    pretrain_gpt.main(argv, world_size=1)
    prefix = "> --model-preset llama-tiny set the flags not given: "
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(prefix)][0][len(prefix):]
    assert "--swiglu " in line + " " and "True" not in line, line
    preset = parse_args(argv, world_size=1)
    pasted = parse_args(argv[:1] + ["--model-preset", "none"] + argv[3:] + shlex.split(line), world_size=1)
    assert preset.preset_values and all(getattr(pasted, key) == value for key, value in preset.preset_values.items())
    assert pasted.preset_values == {}


def test_first_build_of_the_builtin_corpus_is_announced(tmp_path, single_rank_group, capsys, monkeypatch):
    """A run without data flags on an empty --data-cache-path says, before it collects and tokenizes the corpus
    (some seconds), what it is doing, and a second run that finds the corpus does not. Would catch the
    first run's seconds of silence before its first line (the collection is replaced by a small one here)."""
    from megatron_lite.data import corpus

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    def small_corpus():
        print("<collecting>")
        return [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(200)]

    monkeypatch.setattr(corpus, "builtin_corpus_documents", small_corpus)
    argv = tiny_pretrain_flags(mock_data=None, train_iters="1", data_cache_path=str(tmp_path))
    for run in range(2):
        pretrain_gpt.main(argv, world_size=1)
        out = capsys.readouterr().out
        if run == 0:
            announced = out.index("> building the built-in corpus (the docstrings of the Python standard library")
            assert announced < out.index("<collecting>") < out.index("> train:"), out
            assert f"into {tmp_path}{os.sep}stdlib_docs_" in out and "about 5 s" in out
        else:
            assert "<collecting>" not in out and "built-in corpus" not in out, out


def test_megatron_defaults_and_presets():
    """Every flag shared with Megatron-LM defaults to Megatron's value; a preset fills only the flags not
    given (and says which); --model-preset none keeps Megatron's. Would catch recipe values posing as
    Megatron defaults, or a preset overriding an explicit flag."""
    from megatron_lite.training import parse_args

    required = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
                "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "10"]
    plain = parse_args(["--model-preset", "none"] + required, world_size=2)
    megatron = dict(min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0,
                    lr_decay_style="linear", lr_warmup_iters=0, hidden_dropout=0.1, attention_dropout=0.1,
                    init_method_std=0.02, log_interval=100, eval_interval=1000, eval_iters=100, seed=1234,
                    global_batch_size=4, initial_loss_scale=2**32, loss_scale_window=1000, hysteresis=2,
                    check_for_nan_in_loss_and_grad=True, position_embedding_type="learned_absolute")
    assert {k: getattr(plain, k) for k in megatron} == megatron and plain.preset_values == {}
    tiny = parse_args(["--weight-decay", "0.05", "--lr-warmup-iters", "3"], world_size=2)
    assert (tiny.num_layers, tiny.lr, tiny.adam_beta2, tiny.hidden_dropout) == (2, 3e-3, 0.95, 0.0)
    assert tiny.weight_decay == 0.05 and tiny.lr_warmup_iters == 3  # given flags win over the preset
    assert "weight_decay" not in tiny.preset_values and "lr_warmup_fraction" not in tiny.preset_values
    assert tiny.preset_values["lr"] == 3e-3 and parse_args([], world_size=2).lr_warmup_iters == 20
    with pytest.raises(SystemExit):
        parse_args(["--model-preset", "none"], world_size=2)  # the architecture is required then


def test_pretrain_and_live_recovery_run_one_loop():
    """The iteration body is written once (training/loop.py's TrainingLoop, issue 33): pretrain() and live
    recovery both make a TrainingLoop, and neither calls a piece of the body itself. Would catch a second copy
    of the loop growing back in either (a train_step, a log record, an evaluation or a save of its own), which
    then drifts from the other's, as the two loops did before."""
    import ast
    import inspect

    from megatron_lite.fault_tolerance import live_training
    from megatron_lite.training import training

    def called(module):  # the names of the functions and methods `module` calls
        calls = [node.func for node in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(node, ast.Call)]
        return {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None) for f in calls}

    body = {"train_step", "training", "evaluate_validation", "save_checkpoint", "stage", "commit"}
    for module in (training, live_training):
        calls = called(module)
        assert "TrainingLoop" in calls, module.__name__
        assert not calls & body, (module.__name__, calls & body)


def _data_start_timing_worker(argv):
    """pretrain_gpt.main with the train iterator's making and the log's timer starts recorded, in order."""
    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron_lite.training import loop, metrics

    events = []
    make_iterator, restart_timer = loop.micro_batch_iterator, metrics.TrainingLog.restart_timer

    def recorded_iterator(dataset, consumed, *args, **kwargs):
        events.append(("iterator", consumed))
        return make_iterator(dataset, consumed, *args, **kwargs)

    def recorded_restart(log):
        events.append(("timer", None))
        restart_timer(log)
    loop.micro_batch_iterator, metrics.TrainingLog.restart_timer = recorded_iterator, recorded_restart
    try:  # the pool's process is reused: patched only for this run
        pretrain_gpt.main(argv, world_size=dist.get_world_size())
    finally:
        loop.micro_batch_iterator, metrics.TrainingLog.restart_timer = make_iterator, restart_timer
    return events


def test_the_data_loaders_start_is_not_timed_as_training():
    """pretrain() makes the train iterator (with --num-workers, the DataLoader's worker processes start there)
    before the log starts timing its first iteration, as Megatron builds its data iterators before train().
    Would catch the start moving into iteration 1's ms/iteration, throughput and MFU (the one loop at first
    made the iterator after the log and the last words)."""
    argv = tiny_pretrain_flags(train_iters="2")  # the pool's daemonic ranks cannot start workers: the order only
    for events in run_distributed(_data_start_timing_worker, 2, argv):
        assert events[0] == ("iterator", 0), events  # the train iterator (validation's come later), then the timer
        assert ("timer", None) in events[1:], events


def _last_words_after_the_end_worker(argv):
    """A TrainingLoop run to its end as live recovery's generation ends it (the log closed, the last words
    dropped), then an error: the last words the handler writes then. Returns what --save holds."""
    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron_lite.training import initialize_megatron, setup_model_and_optimizer
    from megatron_lite.training.loop import TrainingLoop

    args = pretrain_gpt.parse_args(argv, dist.get_world_size())
    device, tokenizer = initialize_megatron(args)
    train_ds, valid_ds, _ = pretrain_gpt.train_valid_test_datasets_provider(args, tokenizer)
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args, device)
    loop = TrainingLoop(args, pretrain_gpt.forward_step, model, optimizer, scheduler, train_ds, valid_ds, device,
                        None, 0, 0, None)
    loop.run()
    loop.log.close()
    loop.drop_last_words()
    loop.write_last_words(RuntimeError("the supervisor's store is gone"))  # pretrain_live's handler
    return sorted(os.listdir(args.save))


def test_no_last_words_once_they_are_dropped(tmp_path):
    """After a live generation trained to the end, it drops its last words (TrainingLoop.drop_last_words) before
    releasing --save and telling the supervisor (Membership.note_finished); pretrain_live's handler writes the
    last words of any error through the loop. Would catch an error there (a lost store) still writing last
    words of the finished run beside its final checkpoint, which the live loop before the one loop never did
    (its words were None once dropped)."""
    save = str(tmp_path / "save")
    argv = tiny_pretrain_flags(train_iters="2", save=save)
    for entries in run_distributed(_last_words_after_the_end_worker, 2, argv):
        assert "last_words" not in entries, entries
        assert any(entry.startswith("iter_") for entry in entries), entries  # the final save was written


def _metrics_losses(path):
    with open(path) as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r}


def test_torchrun_across_two_nodes_trains_as_one_node(tmp_path):
    """`torchrun --nnodes 2` (c10d rendezvous: node 0's agent hosts the store, the ranks join through it) runs
    pretrain_gpt.py as on one node: two "nodes" of one rank each on this machine give every loss bit-identical
    to `torchrun --standalone --nproc-per-node 2`. Would catch the start-up (initialize_distributed's use of
    torchrun's store, rank and world size from its environment) working on one node only."""
    import socket

    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = [os.path.join(REPO, "pretrain_gpt.py"), *tiny_pretrain_flags(train_iters="4", log_interval="1")]
    run = [sys.executable, "-m", "torch.distributed.run"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(run + ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(k),
                                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                     "--rdzv-id", "two_nodes", *flags, "--metrics-file", str(tmp_path / "nodes.jsonl")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp_path))
             for k in range(2)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    report = "\n".join(f"--- node {k} (exit {node.returncode}):\n{out[-3000:]}"
                       for k, (node, out) in enumerate(zip(nodes, outputs)))
    assert [node.returncode for node in nodes] == [0, 0], report
    one = subprocess.run(run + ["--standalone", "--nproc-per-node", "2", *flags, "--metrics-file",
                                str(tmp_path / "one.jsonl")], capture_output=True, text=True, timeout=240, env=env,
                         cwd=str(tmp_path))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    expected = _metrics_losses(tmp_path / "one.jsonl")
    assert sorted(expected) == [1, 2, 3, 4]
    assert _metrics_losses(tmp_path / "nodes.jsonl") == expected, report
