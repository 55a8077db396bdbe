"""Fine-tuning: optimizer.reload_model_params() after weights are written into the model, and pretrain_gpt.py's
--finetune / --no-load-optim / --no-load-rng (Megatron's semantics: which parts of a checkpoint are loaded)."""

import os
import sys

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, tiny_pretrain_flags

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
NEW_WEIGHTS_SEED = 7  # the "pretrained" weights written into a model initialised with seed 0


# ------------------------------------------------------------------------------------------ reload_model_params
def _build(strategy, dtype, seed=0):
    from ddp_testing import make_model
    from optim_testing import build

    ddp_kwargs = dict(data_parallel_sharding_strategy=strategy, bucket_size=40, overlap_grad_reduce=True,
                      grad_reduce_in_fp32=True)
    if strategy == "optim_grads_params":
        ddp_kwargs["fsdp_unit_modules"] = ()  # SmallNet has no layer list: one unit, the whole model
    opt_kwargs = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.05, use_distributed_optimizer=strategy != "no_shard",
                      bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return build(ddp_kwargs, opt_kwargs, dtype=dtype, model=make_model(seed, dtype))[1:]


def _weights(ddp):
    ddp.finish_param_sync()
    return {k: v.clone() for k, v in ddp.state_dict().items()}  # ZeRO-3: gathered


def _reload_worker(strategy, dtype_name):
    """(a) an optimizer built before the weights were loaded, then reload_model_params(), vs an optimizer
    built on the loaded model: 3 steps; (b) after 2 steps, load + reload: main params become the new weights,
    moments and step counts stay."""
    import torch.distributed as dist
    from ddp_testing import make_model
    from optim_testing import full_state, megatron_steps, states_equal

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    new = make_model(NEW_WEIGHTS_SEED, dtype).state_dict()

    ddp, opt = _build(strategy, dtype)
    ddp.load_state_dict(new)  # ZeRO-3: through the wrapper, which writes the shards
    opt.reload_model_params()
    megatron_steps(ddp, opt, rank, dp, 3, dtype=dtype)
    ref_ddp, ref_opt = _build(strategy, dtype, seed=NEW_WEIGHTS_SEED)
    megatron_steps(ref_ddp, ref_opt, rank, dp, 3, dtype=dtype)
    fresh = dict(weights=all(torch.equal(a, b) for a, b in zip(_weights(ddp).values(), _weights(ref_ddp).values())),
                 state=states_equal(full_state(opt), full_state(ref_opt)))

    ddp, opt = _build(strategy, dtype)
    megatron_steps(ddp, opt, rank, dp, 2, dtype=dtype)
    before = full_state(opt)
    ddp.load_state_dict(new)
    opt.reload_model_params()
    after = full_state(opt)
    expected_params = {name: new[name].float() for name in after}
    kept = dict(params=all(torch.equal(after[n]["param"], expected_params[n]) for n in after),
                moments=all(torch.equal(after[n][k], before[n][k]) for n in after for k in after[n] if k != "param"),
                step=opt.update_count == 2)
    return fresh, kept


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_reload_model_params_starts_from_the_loaded_weights(strategy, dtype_name):
    """Weights loaded into the model after the optimizer was built: after reload_model_params() the steps are
    bitwise those of an optimizer built on the loaded model (every optimizer: FP32Optimizer, the bf16 one
    with fp32 main copies, the distributed optimizer on ZeRO-1/2/3). Would catch stale fp32 main params
    (the old weights written back over the loaded ones at the next step), a ZeRO-3 shard not refreshed, or
    a reload that drops the moments (megatron-core keeps them)."""
    for fresh, kept in run_distributed(_reload_worker, 2, strategy, dtype_name):
        assert fresh == dict(weights=True, state=True), fresh
        assert kept == dict(params=True, moments=True, step=True), kept


def _reload_from_state_dict_worker(strategy, dtype_name):
    """The model gets the new weights rounded to bf16, the optimizer reload_model_params(state_dict) with them
    in fp32, in each of megatron-core's forms. Returns per form whether every main param equals the fp32 value
    bitwise, and the errors of a state dict without a parameter, with a wrong shape, and of a list."""
    from ddp_testing import make_model
    from optim_testing import full_state

    dtype = getattr(torch, dtype_name)
    new = {k: v.double().mul(1 + 2 ** -12).float() for k, v in make_model(NEW_WEIGHTS_SEED).state_dict().items()}
    forms = {"plain": new, "model": {"model": new}, "model0": {"model0": new}, "model_0": {"model_0": new},
             "module. prefix": {f"module.{k}": v for k, v in new.items()}}
    out = {}
    for form, state_dict in forms.items():
        ddp, opt = _build(strategy, dtype)
        ddp.load_state_dict({k: v.bfloat16().to(dtype) for k, v in new.items()})  # rounded, as a bf16 model's
        opt.reload_model_params(state_dict)
        after = full_state(opt)
        out[form] = all(torch.equal(after[name]["param"], new[name]) for name in after)
    ddp, opt = _build(strategy, dtype)
    name = next(iter(new))
    for case, state_dict in {"missing": {k: v for k, v in new.items() if k != name},
                             "shape": {**new, name: new[name].reshape(-1)[:-1]}, "type": list(new.values())}.items():
        try:
            opt.reload_model_params(state_dict)
            out[case] = None
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_reload_model_params_from_a_state_dict(strategy, dtype_name):
    """megatron-core's reload_model_params(state_dict): the main params (fp32) take the state dict's values,
    not the model's (for bf16, rounded ones), in megatron-core's forms of the argument. Would catch the
    TypeError of a reload without the argument, the state dict ignored (bf16: main params rounded), a shard
    cut from the wrong range of the parameter, or a state dict lacking a parameter accepted silently."""
    from ddp_testing import make_model

    name = next(iter(make_model(NEW_WEIGHTS_SEED).state_dict()))
    for out in run_distributed(_reload_from_state_dict_worker, 2, strategy, dtype_name):
        assert all(out[form] for form in ("plain", "model", "model0", "model_0", "module. prefix")), out
        assert out["missing"].startswith("ValueError") and f"trained parameter {name}" in out["missing"]
        assert out["shape"].startswith("ValueError") and "has shape" in out["shape"]
        assert out["type"].startswith("TypeError") and "a dict of tensors" in out["type"]


# ------------------------------------------------------------------------------------------ pretrain_gpt.py
TINY = tiny_pretrain_flags(mock_data=None, train_iters=None, hidden_size="64", num_attention_heads="4", seq_length="64",
                           log_interval="4", eval_iters="1", lr="3e-3", min_lr="3e-4", lr_warmup_iters="2",
                           eval_interval="1000", hidden_dropout="0.1")  # dropout: the RNG state matters


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


def _pretrain_worker(argv, weights=None):
    """pretrain_gpt's pretrain() on this rank; with `weights` (a model state dict) the model provider loads
    them into the freshly built GPT: a run that starts from those weights without any checkpoint.
    Returns {iteration: lm loss}."""
    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron_lite.training import parse_args, pretrain

    def provider(args):
        model = pretrain_gpt.model_provider(args)  # the same RNG draws as the run it is compared with
        model.load_state_dict(weights)
        return model

    args = parse_args(argv, world_size=dist.get_world_size())
    result = pretrain(args, pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider if weights is None else provider, pretrain_gpt.forward_step)
    return {iteration: reported["lm loss"] for iteration, reported in result["losses"].items()}


def _checkpoint(save_dir):
    """The newest checkpoint under save_dir in the `torch` format's layout, whichever format wrote it."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    return checkpoint_convert.read(os.path.join(save_dir, f"iter_{iteration:07d}"))


@pytest.mark.parametrize("flags", [
    ["--use-distributed-optimizer"],  # the torch_dist format (the default), fp32
    ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce", "--bf16", "--ckpt-format",
     "torch"],
], ids=["zero1-fp32-torch_dist", "zero3-bf16-torch"])
def test_finetune_loads_the_weights_only_and_starts_at_iteration_0(data_cache, tmp_path, flags):
    """--finetune --load DIR (a checkpoint at iteration 4 with moments, a schedule past its warmup and a
    used RNG) logs iterations 1..4 with the losses, bit for bit, of a run whose model provider hands out
    the checkpoint's weights: fresh optimizer and schedule, data from the beginning, RNG of a fresh start.
    Would catch any of those loaded, the iteration or data position taken from the checkpoint (nothing to
    train: it is at 4 already), or (bf16) stale fp32 main params written over the loaded weights."""
    common = TINY + flags + ["--train-iters", "4", "--data-cache-path", data_cache]
    run_distributed(_pretrain_worker, 2, common + ["--save", str(tmp_path / "pre")])
    weights = _checkpoint(tmp_path / "pre")["model"]
    reference = run_distributed(_pretrain_worker, 2, common, weights)[0]
    finetuned = run_distributed(_pretrain_worker, 2, common + ["--finetune", "--load", str(tmp_path / "pre"),
                                                               "--save", str(tmp_path / "ft")])[0]
    assert sorted(finetuned) == [1, 2, 3, 4]
    assert finetuned == reference
    saved = _checkpoint(tmp_path / "ft")
    assert saved["iteration"] == 4 and saved["consumed_train_samples"] == 32
    assert saved["opt_param_scheduler"]["num_steps"] == 4



def test_finetune_into_the_checkpoints_directory_is_refused(data_cache, tmp_path):
    """--finetune --load DIR --save DIR: the run restarts at iteration 0, so its checkpoints would overwrite
    DIR's or be shadowed by them (the newest is loaded). Would catch a fine-tuning run treated as a resume
    from DIR by the shadowing check. Every rank raises."""
    common = TINY + ["--train-iters", "2", "--data-cache-path", data_cache, "--ckpt-format", "torch"]
    pre = str(tmp_path / "pre")
    run_distributed(_pretrain_worker, 2, common + ["--save", pre])
    with pytest.raises(AssertionError) as failure:
        run_distributed(_pretrain_worker, 2, common + ["--finetune", "--load", pre, "--save", pre])
    assert str(failure.value).count("a --finetune run starts again at iteration 0") == 2


def test_pretrained_checkpoint_makes_a_fine_tuning_restartable(data_cache, tmp_path):
    """--load FT --save FT --pretrained-checkpoint PRE (Megatron's flag): the first start fine-tunes from PRE
    (as --finetune: iteration 1..); stopped after its save at 3 and started again with the same command, it
    resumes from FT at 3, and iterations 4..6 are bitwise those of an uninterrupted fine-tuning. Would catch
    the restart fine-tuning from PRE again (iteration 1, or refused as shadowing FT's checkpoints, as
    --finetune --load PRE --save FT is), or the first start not loading PRE."""
    common = TINY + ["--use-distributed-optimizer", "--data-cache-path", data_cache]
    pre, ref, ft = (str(tmp_path / name) for name in ("pre", "ref", "ft"))
    run_distributed(_pretrain_worker, 2, common + ["--train-iters", "4", "--save", pre])
    finetune = common + ["--train-iters", "6", "--pretrained-checkpoint", pre, "--save-interval", "3"]
    reference = run_distributed(_pretrain_worker, 2, finetune + ["--load", ref, "--save", ref])[0]
    scratch = run_distributed(_pretrain_worker, 2, common + ["--train-iters", "6"])[0]
    assert sorted(reference) == list(range(1, 7)) and reference[1] != scratch[1]  # PRE's weights were loaded
    first = run_distributed(_pretrain_worker, 2, finetune + ["--load", ft, "--save", ft, "--exit-interval", "3"])[0]
    again = run_distributed(_pretrain_worker, 2, finetune + ["--load", ft, "--save", ft])[0]
    assert first == {i: reference[i] for i in (1, 2, 3)}
    assert again == {i: reference[i] for i in (4, 5, 6)}


def test_no_load_optim_and_no_load_rng(data_cache, tmp_path):
    """A checkpoint at iteration 4 of 8, resumed three ways. --no-load-optim: iterations 5..8 on the same
    data; iteration 5's loss (computed before any update: weights, data and RNG only) equals the plain
    resume's, later ones differ; the saved optimizer has taken 4 steps and the schedule 4 (both fresh, as
    in Megatron). --no-load-rng: the optimizer and schedule continue (8 steps) but iteration 5's dropout
    draws differ. Would catch a flag that is ignored, or one that also drops the iteration count or the
    data position."""
    common = TINY + ["--use-distributed-optimizer", "--train-iters", "8", "--data-cache-path", data_cache]
    pre = str(tmp_path / "pre")
    run_distributed(_pretrain_worker, 2, common + ["--save", pre, "--exit-interval", "4"])
    runs = {}
    for name, extra in (("resume", []), ("no_optim", ["--no-load-optim"]), ("no_rng", ["--no-load-rng"])):
        runs[name] = run_distributed(_pretrain_worker, 2, common + extra + ["--load", pre, "--save",
                                                                            str(tmp_path / name)])[0]
        assert sorted(runs[name]) == [5, 6, 7, 8], (name, runs[name])
    assert runs["no_optim"][5] == runs["resume"][5] and runs["no_optim"][6] != runs["resume"][6]
    assert runs["no_rng"][5] != runs["resume"][5]
    for name, steps in (("resume", 8), ("no_optim", 4), ("no_rng", 8)):
        saved = _checkpoint(tmp_path / name)
        assert (saved["iteration"], saved["consumed_train_samples"]) == (8, 64), name
        assert saved["opt_param_scheduler"]["num_steps"] == steps, name
        assert {entry["step"] for entry in saved["optimizer"]["state"].values()} == {steps}, name


# ------------------------------------------------------------------------------------------ from last words
def _last_words_worker(root, strategy):
    """bf16, 2 steps with last words written; a fresh model, optimizer and schedule loaded from them with
    load_checkpoint(finetune=True); and a fourth with load_optim=False only (the iteration kept)."""
    import torch.distributed as dist
    from optim_testing import full_state, megatron_steps

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import last_words
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    ddp, opt = _build(strategy, torch.bfloat16)
    scheduler = OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")
    words = last_words.LastWords(root, opt, scheduler, 0, 0)
    for k in range(2):
        words.stage(k + 1, (k + 1) * 8)
        megatron_steps(ddp, opt, rank, dp, 1, first_step=k, dtype=torch.bfloat16)
        scheduler.step()
        words.commit()
    expected = _weights(ddp)
    words.write("test: a peer died")
    dist.barrier()
    out = {}
    for name, kwargs in (("finetune", dict(finetune=True)), ("no_load_optim", dict(load_optim=False))):
        ddp, opt = _build(strategy, torch.bfloat16, seed=3)
        scheduler = OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 6, "cosine")
        loaded = checkpointing.load_checkpoint(root, ddp, opt, scheduler, **kwargs)
        state = full_state(opt)
        out[name] = dict(iteration=(loaded["iteration"], loaded["checkpoint_iteration"]),
                         weights=all(torch.equal(a, b) for a, b in zip(_weights(ddp).values(), expected.values())),
                         main=all(torch.equal(state[n]["param"], expected[n].float()) for n in state),
                         fresh=(opt.update_count, scheduler.num_steps, len(opt.optimizer.state)))
    return out


def test_finetune_and_no_load_optim_from_last_words(tmp_path):
    """--load takes a last-words set when it is the newest state; --finetune and --no-load-optim take only
    its parameters from it (bf16 model = the cast of the saved fp32 main params, main params = the model's)
    and leave the optimizer and the schedule fresh. Would catch the last-words path loading moments, step or
    schedule anyway, or main params left at the fresh model's initial weights."""
    for out in run_distributed(_last_words_worker, 2, str(tmp_path), "optim"):
        assert out["finetune"] == dict(iteration=(0, 2), weights=True, main=True, fresh=(0, 0, 0))
        assert out["no_load_optim"] == dict(iteration=(2, 2), weights=True, main=True, fresh=(0, 0, 0))


# ------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--finetune"], "--finetune needs --load"),
        (["--no-load-optim"], "--no-load-optim needs --load"),
        (["--no-load-rng"], "--no-load-rng needs --load"),
        (["--load", "d", "--finetune", "--use-checkpoint-opt_param-scheduler"], "--finetune does not load"),
        (["--load", "d", "--no-load-optim", "--use-checkpoint-opt_param-scheduler"], "--no-load-optim does not"),
        (["--load", "d", "--finetune", "--pretrained-checkpoint", "p"], "--pretrained-checkpoint fine-tunes from it"),
        (["--load", "d", "--exit-on-missing-checkpoint", "--pretrained-checkpoint", "p"], "an empty --load is"),
    ],
)
def test_bad_load_flags_fail_at_start_up(argv, message, capsys):
    """Would catch a flag that silently does nothing: without --load there is nothing to leave out, and the
    checkpoint's schedule cannot be taken when it is not loaded."""
    from megatron_lite.training import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=2)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_load_flags_are_documented():
    """--help and docs/pretrain_gpt.md describe the three flags (would catch a flag added without its docs)."""
    from megatron_lite.training import build_parser, parse_args

    help_text = " ".join(build_parser().format_help().split())
    docs = open(os.path.join(REPO, "docs", "pretrain_gpt.md")).read()
    for flag, words in (("--finetune", "load the model weights only"), ("--no-load-optim", "learning-rate "
                        "schedule's position"), ("--no-load-rng", "do not restore the RNG state")):
        assert f"{flag} " in help_text and words in help_text and f"`{flag}`" in docs, flag
    args = parse_args(["--load", "d", "--finetune", "--no-load-optim", "--no-load-rng"], world_size=1)
    assert (args.finetune, args.no_load_optim, args.no_load_rng) == (True, True, True)
