"""Megatron-LM checkpoints -> megatron-lite (tools/checkpoint_convert.py --from megatron,
megatron_lite/checkpointing/megatron_read.py), against megatron-core 0.16.1 itself.

One subprocess (tests/support/mcore_save.py) trains megatron-core's GPTModel with its DDP, Adam optimizer and
sample-counted scheduler and writes, at iteration 3, the checkpoints Megatron-LM writes: torch_dist and legacy
torch of a GPT-2-class run (non-distributed optimizer); torch_dist 'dp_reshardable' and legacy torch (with
distrib_optim.pt) of a Llama-class run (distributed optimizer in 3 buckets, 4 heads in 2 query groups);
torch_dist 'fully_reshardable' of the same model in one bucket (megatron-core 0.16.1's own fully_reshardable
save is wrong past the first bucket: mcore_save.py); and the reference: logits at the save, the losses of 3 more
iterations. Here each is converted, loaded by megatron-lite and compared:

  * logits within 1e-6 of megatron-core's (the fused QKV rows regrouped: skipping it is off by 1e-1);
  * a continuation: megatron-lite resumes from the converted checkpoint (weights, Adam moments and step, the
    schedule converted from samples to iterations) and repeats megatron-core's 3 losses within 2e-6 relative.
    Measured: equal to the bit on this machine; the bound is fp32 rounding, room for other attention and
    cross-entropy kernels (their logits differ by ~1e-7); moments left at zero are 1e-3 off;
  * pretrain_gpt.py --load with the printed command resumes, --finetune --load trains on the weights alone;
  * refusals: an optimizer form not read (a chained optimizer, distrib_optim.pt missing), a misplaced state
    (megatron-core's own multi-bucket fully_reshardable save), shapes that disagree with the args, missing
    files, an architecture flag GPTModel lacks, each naming the key or field and the remedy; and a pickled
    object in the checkpoint is never constructed.
Those are skipped without megatron-core (pip install -e ".[megatron]"); the round trip through megatron_write.py's
export (--to megatron, both formats) back to an equal checkpoint runs without it.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from mcore_reference import HAVE_MCORE
from pretrain_testing import REPO, tiny_pretrain_flags

from megatron_lite.checkpointing import files, foreign_pickle, megatron_lm, megatron_read
from megatron_lite.checkpointing.save import ARCHITECTURE_ARGS
from megatron_lite.models import GPTModel

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402
import hf_convert  # noqa: E402

RUNS = {"gpt2_dist": "gpt2", "gpt2_torch": "gpt2", "llama_dp": "llama", "llama_torch": "llama",
        "llama_full": "llama_one_bucket"}  # checkpoint -> the megatron-core run that wrote it (mcore_save.py)
RESUMABLE = list(RUNS)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """(directory of megatron-core's checkpoints, the reference of mcore_save.py); every test that uses it is
    skipped without megatron-core."""
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install -e '.[megatron]')")
    out = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "mcore_save.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(out), torch.load(os.path.join(out, "reference.pt"), weights_only=True)


def convert(source, output, *flags):
    """checkpoint_convert.py --from megatron; returns the written checkpoint read back (checkpoint_convert.read)."""
    checkpoint_convert.main(["--from", "megatron", "--input", source, "--output", output, *flags])
    (name,) = [n for n in os.listdir(output) if n.startswith("iter_")]
    return checkpoint_convert.read(os.path.join(output, name))


def lite_model(payload):
    model = GPTModel(hf_convert.gpt_config(payload["args"]))
    model.load_state_dict(payload["model"], strict=False)  # a tied output layer is stored once
    return model.eval()


@pytest.mark.parametrize("name", list(RUNS))
def test_converted_weights_give_megatron_core_logits(megatron, tmp_path, name):
    """Weights of every format and model class -> megatron-lite: logits within 1e-6 of megatron-core's. Catches a
    wrong name (TE norm names, stacked layers), a QKV not regrouped, a dropped padding row."""
    out, reference = megatron
    payload = convert(os.path.join(out, name), str(tmp_path / "c"), "--weights-only")
    with torch.no_grad():
        logits = lite_model(payload)(reference["probe"])
    torch.testing.assert_close(logits, reference[RUNS[name]]["logits"], atol=1e-6, rtol=0)


def test_skipping_the_qkv_regrouping_is_caught(megatron, monkeypatch):
    """The logits check above fails when the QKV rows are copied as they are (megatron-core's per-group
    [q_g | k_g | v_g] read as [q | k | v]): every other name and shape still fits."""
    out, reference = megatron
    monkeypatch.setattr(megatron_lm, "qkv_from_megatron", lambda tensor, heads, groups: tensor.clone())
    for name in ("gpt2_torch", "llama_full"):
        payload, _ = megatron_read.read_megatron(os.path.join(out, name), weights_only=True)
        with torch.no_grad():
            logits = lite_model(payload)(reference["probe"])
        assert (logits - reference[RUNS[name]]["logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("legacy, by_key", [("gpt2_torch", "gpt2_dist"), ("llama_torch", "llama_dp")])
def test_legacy_index_order_gives_the_state_torch_dist_keys_by_name(megatron, tmp_path, legacy, by_key):
    """The legacy optimizer numbers its parameters (megatron-core's param-group and registration order,
    megatron_lm.LAYER_STATE_DICT_ORDER); torch_dist names them. megatron-core saved the same state both ways, so
    both convert to the same state, bit for bit. Catches an index order that maps moments to another parameter
    of the same shape (a norm's weight and bias), which the short continuation's losses do not resolve."""
    one = convert(os.path.join(megatron[0], legacy), str(tmp_path / "legacy"))["optimizer"]["state"]
    other = convert(os.path.join(megatron[0], by_key), str(tmp_path / "by_key"))["optimizer"]["state"]
    assert one.keys() == other.keys()
    for name, fields in one.items():
        assert fields.keys() == other[name].keys(), name
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other[name][field])), (name, field)


@pytest.mark.parametrize("name", RESUMABLE)
def test_continuation_repeats_megatron_core_losses(megatron, tmp_path, single_rank_group, name):
    """megatron-lite resumes from the converted checkpoint (optimizer state, step, schedule moved) and its 3 losses
    equal those megatron-core computed after its save, within 2e-6 relative (fp32 rounding of other kernels).
    Catches moments mapped to the wrong parameter (legacy index order) or not regrouped, a step or schedule
    position off by one, the schedule left in samples. The save lies mid-warmup (3 of 4 iterations) and the
    continuation runs into the cosine decay: a warmup one iteration short fails all five."""
    import mcore_save as ms

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.checkpointing import load_checkpoint
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    out, reference = megatron
    payload = convert(os.path.join(out, name), str(tmp_path / "c"))
    assert payload["iteration"] == ms.SAVE_AT and payload["consumed_train_samples"] == ms.SAVE_AT * ms.MICRO_BATCH
    assert payload["opt_param_scheduler"]["num_steps"] == ms.SAVE_AT
    model = GPTModel(hf_convert.gpt_config(payload["args"]))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(), single_rank_group)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=ms.LR, min_lr=ms.MIN_LR, weight_decay=ms.WEIGHT_DECAY, adam_beta1=ms.BETAS[0],
        adam_beta2=ms.BETAS[1], adam_eps=ms.EPS, clip_grad=0.0), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, ms.LR, ms.MIN_LR, ms.WARMUP_ITERS, ms.DECAY_ITERS, "cosine")
    loaded = load_checkpoint(str(tmp_path / "c"), ddp, optimizer, scheduler, group=single_rank_group)
    assert loaded["iteration"] == ms.SAVE_AT
    losses = []
    for batch in reference["batches"][ms.SAVE_AT:]:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[RUNS[name]]["losses"]), rtol=2e-6, atol=0)


def _printed_command(capsys):
    text = capsys.readouterr().out
    found = re.search(r"pretrain_gpt\.py (.*?) \(and the run", text)
    assert found, text
    return found.group(1).split()


def test_pretrain_gpt_resumes_and_finetunes(megatron, tmp_path, capsys):
    """The printed commands work: pretrain_gpt.py --load resumes at Megatron's iteration (the architecture,
    optimizer hyperparameters and schedule of the converted checkpoint pass its checks), and --finetune --load
    trains on the weights alone (--weights-only). The tokenizer comes from the printed flags (Megatron-LM's
    NullTokenizer --vocab-size 127 is megatron-lite's 128: the same eod 127)."""
    out, _ = megatron
    data = ["--mock-data", "--micro-batch-size", "4", "--eval-iters", "0", "--log-interval", "1"]
    checkpoint_convert.main(["--from", "megatron", "--input", os.path.join(out, "llama_full"), "--output",
                             str(tmp_path / "resume"), "--to", "torch_dist"])
    resume = _printed_command(capsys)
    checkpoint_convert.main(["--from", "megatron", "--input", os.path.join(out, "llama_torch"), "--output",
                             str(tmp_path / "tune"), "--weights-only"])
    finetune = _printed_command(capsys)
    assert resume[0] == "--load" and finetune[:2] == ["--finetune", "--load"]
    env = {**os.environ, "PYTHONPATH": REPO}
    for flags, first in ((resume + ["--train-iters", "5"], 4),
                         (finetune + ["--seq-length", "8", "--global-batch-size", "4", "--train-iters", "2"], 1)):
        done = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *flags, *data], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        iterations = [int(i) for i in re.findall(r"iteration\s+(\d+)/", done.stdout)]
        assert iterations and iterations[0] == first, done.stdout[-2000:]


# ------------------------------------------------------------------------------------------ refusals
def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        checkpoint_convert.main(list(argv))
    return capsys.readouterr().err


def test_unreadable_optimizer_state_is_refused_with_the_remedy(megatron, tmp_path, capsys):
    """An optimizer state this reader does not convert (a chained optimizer's list; a legacy distributed
    optimizer without its distrib_optim.pt) is refused naming it and the remedy, nothing written (never silently
    weights only); --weights-only converts the weights."""
    def chained(state):
        state["optimizer"] = [state["optimizer"], state["optimizer"]]

    source = _legacy_copy(megatron, tmp_path / "a", chained)
    err = refused(capsys, "--from", "megatron", "--input", source, "--output", str(tmp_path / "a" / "c"))
    assert "a chained optimizer of 2" in err and "--weights-only" in err
    assert not os.path.exists(tmp_path / "a" / "c")
    out, _ = megatron
    root = tmp_path / "b"
    shutil.copytree(os.path.join(out, "llama_torch"), root)
    os.remove(root / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt")
    err = refused(capsys, "--from", "megatron", "--input", str(root), "--output", str(tmp_path / "b" / "c"))
    assert "lacks" in err and "distrib_optim.pt" in err and "--weights-only" in err
    checkpoint_convert.main(["--from", "megatron", "--input", str(root), "--output", str(tmp_path / "b" / "c"),
                             "--weights-only"])


def test_misplaced_optimizer_state_is_refused(megatron, tmp_path, capsys):
    """megatron-core 0.16.1's fully_reshardable save of a distributed optimizer with several buckets stores the
    state of later buckets at other parameters' positions (its own 'data corruption' warning). The converter
    sees the main params disagree with the weights and refuses, naming the cause and the remedy; the weights
    convert alone. Would catch resuming with moments of the wrong parameters."""
    out, _ = megatron
    source = os.path.join(out, "llama_full_buckets")
    err = refused(capsys, "--from", "megatron", "--input", source, "--output", str(tmp_path / "c"))
    assert "main params of" in err and "misplaced" in err and "dp_reshardable" in err and "--weights-only" in err
    assert not os.path.exists(tmp_path / "c")
    checkpoint_convert.main(["--from", "megatron", "--input", source, "--output", str(tmp_path / "c"),
                             "--weights-only"])


def _legacy_copy(megatron, tmp_path, change):
    """A copy of the legacy GPT-2 checkpoint with `change(state)` applied (the test's own file: plain torch.load)."""
    out, _ = megatron
    os.makedirs(tmp_path, exist_ok=True)
    root = tmp_path / "legacy"
    shutil.copytree(os.path.join(out, "gpt2_torch"), root)
    path = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)
    return str(root)


def test_mismatched_shapes_and_flags_are_refused(megatron, tmp_path, capsys):
    """Args that do not describe the tensors, an optimizer moment of another shape, and a flag GPTModel lacks:
    each refused naming the key or field."""
    def wider(state):
        state["args"].ffn_hidden_size = 64

    err = refused(capsys, "--from", "megatron", "--input", _legacy_copy(megatron, tmp_path / "a", wider),
                  "--output", str(tmp_path / "a" / "c"))
    assert "decoder.layers.0.mlp.linear_fc1.weight has shape [128, 32]" in err and "[64, 32]" in err

    def moment(state):
        state["optimizer"]["state"][2]["exp_avg"] = torch.zeros(3)

    err = refused(capsys, "--from", "megatron", "--input", _legacy_copy(megatron, tmp_path / "b", moment),
                  "--output", str(tmp_path / "b" / "c"))
    assert "optimizer state 2 exp_avg has shape [3]" in err and "--weights-only" in err

    def qk_norm(state):
        state["args"].qk_layernorm = True

    err = refused(capsys, "--from", "megatron", "--input", _legacy_copy(megatron, tmp_path / "d", qk_norm),
                  "--output", str(tmp_path / "d" / "c"))
    assert "args.qk_layernorm=True" in err


def test_missing_files_are_refused(megatron, tmp_path, capsys):
    """No tracker (remedy: --iteration), no common.pt, no checkpoint directory: each named."""
    out, _ = megatron
    root = tmp_path / "dist"
    shutil.copytree(os.path.join(out, "gpt2_dist"), root)
    os.remove(root / "latest_checkpointed_iteration.txt")
    err = refused(capsys, "--from", "megatron", "--input", str(root), "--output", str(tmp_path / "c"))
    assert "latest_checkpointed_iteration.txt" in err and "--iteration" in err
    err = refused(capsys, "--from", "megatron", "--input", str(root), "--iteration", "7", "--output",
                  str(tmp_path / "c"))
    assert "iter_0000007 does not exist" in err
    os.remove(root / "iter_0000003" / "common.pt")
    err = refused(capsys, "--from", "megatron", "--input", str(root), "--iteration", "3", "--output",
                  str(tmp_path / "c"))
    assert "common.pt" in err


class _Trap:
    """Pickles as a call of `function(*args)`: what a hostile checkpoint would do."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def test_pickled_code_is_never_run(megatron, tmp_path, capsys):
    """An object in a legacy checkpoint whose unpickling would call a function: shutil.copyfile stays an inert
    placeholder (the weights still convert, nothing is copied); os.makedirs (a module torch's weights-only
    unpickler blocks) makes the file unreadable, refused naming it. Neither function runs."""
    copied, made = str(tmp_path / "copied"), str(tmp_path / "made")
    source = _legacy_copy(megatron, tmp_path / "a", lambda state: state.update(
        extra=_Trap(shutil.copyfile, os.path.join(REPO, "README.md"), copied)))
    payload, _ = megatron_read.read_megatron(source, weights_only=True)
    assert not os.path.exists(copied) and "word_embeddings.weight" in payload["model"]
    legacy = os.path.join(source, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    assert isinstance(foreign_pickle.load(legacy, "x")["extra"], foreign_pickle.Placeholder)
    source = _legacy_copy(megatron, tmp_path / "b", lambda state: state.update(extra=_Trap(os.makedirs, made)))
    err = refused(capsys, "--from", "megatron", "--input", source, "--output", str(tmp_path / "b" / "c"))
    assert "model_optim_rng.pt cannot be read" in err and not os.path.exists(made)


@pytest.mark.parametrize("megatron_format, bf16, tokenizer", [("torch", False, ["NullTokenizer", "100"]),
                                                               ("torch", True, None), ("torch_dist", True, None)])
def test_round_trip_through_megatron_lm_formats_is_exact(tmp_path, megatron_format, bf16, tokenizer):
    """A megatron-lite checkpoint exported as Megatron-LM's (--to megatron) and imported back (--from megatron)
    is the same checkpoint: weights (and their dtype) and Adam state bitwise, step, schedule, iteration, consumed
    samples, RNG, architecture; bf16 through Megatron's fp32 main params (legacy fp32_from_fp16_params, torch_dist
    optimizer.state.fp32_param). Catches the two directions disagreeing on names, QKV rows, the legacy
    optimizer's index order (megatron-core's registration order, whatever order the model dict lists), the
    schedule's units, NullTokenizer's vocab_size (Megatron-LM's counts its eod apart) and eod."""
    save = str(tmp_path / "lite")
    vocab = dict(tokenizer_type=tokenizer[0], vocab_size=tokenizer[1]) if tokenizer else {}
    done = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *tiny_pretrain_flags(
        train_iters="3", save=save, save_interval="3", ckpt_format="torch", lr_warmup_iters="1", bf16=bf16 or None,
        **vocab)],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    exported, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    checkpoint_convert.main(["--input", save, "--output", exported, "--to", "megatron", "--megatron-format",
                             megatron_format])
    checkpoint_convert.main(["--from", "megatron", "--input", exported, "--output", back])
    before = checkpoint_convert.read(os.path.join(save, "iter_0000003"))
    after = checkpoint_convert.read(os.path.join(back, "iter_0000003"))
    for key in ("iteration", "consumed_train_samples", "opt_param_scheduler"):
        assert after[key] == before[key], key
    # The architecture (the tokenizer is recorded in Megatron-LM's terms, which have no ByteLevelTokenizer).
    recorded = [k for k in ARCHITECTURE_ARGS if before["args"].get(k) is not None]
    assert {k: after["args"][k] for k in recorded} == {k: before["args"][k] for k in recorded}
    if tokenizer:
        assert [after["args"][k] for k in ("tokenizer_type", "vocab_size", "eod")] == ["NullTokenizer", 100, 99]
    assert before["model"].keys() == after["model"].keys()
    assert all(torch.equal(before["model"][k], after["model"][k]) and before["model"][k].dtype ==
               after["model"][k].dtype for k in before["model"])
    state, state_after = before["optimizer"]["state"], after["optimizer"]["state"]
    assert state.keys() == state_after.keys()
    for name, fields in state.items():
        assert state_after[name]["step"] == fields["step"] == 3
        assert all(torch.equal(fields[f], state_after[name][f]) for f in ("param", "exp_avg", "exp_avg_sq")), name
    assert after["optimizer"]["param_groups"] == before["optimizer"]["param_groups"]
    rng, rng_after = before["rng_state"][0], after["rng_state"][0]
    assert list(rng["python"][1]) == list(rng_after["python"][1]) and torch.equal(rng["torch"], rng_after["torch"])
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(rng["numpy"], rng_after["numpy"]))


def test_a_null_tokenizer_run_keeps_megatron_lms_eod_and_vocabulary(tmp_path):
    """Megatron-LM's NullTokenizer puts its eod AFTER --vocab-size N ids (vocab N+1, eod N: megatron/training/
    tokenizer/tokenizer.py _NullTokenizer at core_v0.16.1; megatron.core.tokenizers' NullTokenizer the same);
    megatron-lite's counts it among them (eod = vocab_size - 1). The import records vocab_size N+1 and eod N, so
    megatron-lite's tokenizer of the recorded size has Megatron-LM's eod and padded vocabulary, and a resume with
    Megatron-LM's own --vocab-size N (eod N-1, the same 128 padded rows) is refused, not trained with another eod.
    Catches the copied vocab_size (eod one lower: --eod-mask-loss and document boundaries silently moved)."""
    from megatron_lite.data.tokenizer import build_tokenizer, check_trained_eod
    from megatron_lite.training.initialize import vocab_size_with_padding

    megatron_args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                         padded_vocab_size=128, tokenizer_type="NullTokenizer", vocab_size=120)
    lite = megatron_read.megatron_args_to_lite(argparse.Namespace(**megatron_args))
    assert (lite["vocab_size"], lite["eod"]) == (121, 120)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=lite["vocab_size"])
    assert tokenizer.eod == 120 and vocab_size_with_padding(tokenizer.vocab_size) == 128
    with pytest.raises(ValueError, match="eod 120"):
        check_trained_eod(lite, "NullTokenizer", None, build_tokenizer("NullTokenizer", vocab_size=120).eod, "x")
    flags = checkpoint_convert.megatron_flags({"args": lite, files.WEIGHTS_ONLY_KEY: "x"}, argparse.Namespace())
    assert "--tokenizer-type NullTokenizer --vocab-size 121 " in " ".join(flags)


def _megatron_run_args(**changes) -> argparse.Namespace:
    """Megatron-LM args of a GPT-2-class run with its defaults where they differ from megatron-lite's preset."""
    return argparse.Namespace(**{
        **dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
               padded_vocab_size=128, tokenizer_type="NullTokenizer", vocab_size=127, seq_length=16,
               global_batch_size=4, consumed_train_samples=12, hidden_dropout=0.1, attention_dropout=0.1, seed=42,
               train_iters=1000, eval_interval=500, eval_iters=7, eod_mask_loss=True, clip_grad=1.0,
               calculate_per_token_loss=True),
        **changes})


def test_the_printed_command_continues_megatron_lms_run_not_the_preset():
    """pretrain_gpt.py of the printed command (plus --mock-data) has the Megatron-LM run's dropout, seed,
    --train-iters and evaluation sizes (which fix the train and validation samples: megatron-core's sample
    count), --eod-mask-loss and --calculate-per-token-loss. Catches the flags left to megatron-lite's
    --model-preset tiny, which fills what is not given with its recipe: dropout 0.0 (Megatron-LM's default 0.1),
    train_iters 200, eval 100 x 5. A run with --reset-position-ids (which megatron-lite lacks) is refused, one
    with another sample order (--dataloader-type cyclic, FIM data), and one whose eod megatron-lite's tokenizer
    would change (--legacy-tokenizer's SentencePieceTokenizer: <EOD>)."""
    from megatron_lite.training.arguments import parse_args

    megatron = _megatron_run_args()
    lite = megatron_read.megatron_args_to_lite(megatron)
    payload = {"args": lite, "iteration": 3, "opt_param_scheduler": {}, "optimizer": {"param_groups": [
        {"wd_mult": 1.0, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}]}}
    args = parse_args(checkpoint_convert.megatron_flags(payload, megatron) + ["--mock-data", "--lr", "1e-3"],
                      world_size=1)
    for key in ("hidden_dropout", "attention_dropout", "seed", "train_iters", "eval_interval", "eval_iters",
                "eod_mask_loss", "seq_length", "global_batch_size", "clip_grad", "calculate_per_token_loss"):
        assert getattr(args, key) == getattr(megatron, key), key
    finetune = parse_args(checkpoint_convert.megatron_flags({**payload, files.WEIGHTS_ONLY_KEY: "x"}, megatron)
                          + ["--mock-data", "--lr", "1e-3", "--seq-length", "16"], world_size=1)
    assert (finetune.hidden_dropout, finetune.attention_dropout) == (0.1, 0.1)
    with pytest.raises(ValueError, match=r"args.reset_position_ids=True.*--weights-only"):
        checkpoint_convert.megatron_flags(payload, _megatron_run_args(reset_position_ids=True))
    for change in (dict(dataloader_type="cyclic"), dict(fim_data=True)):
        with pytest.raises(ValueError, match=rf"args.{next(iter(change))}=.*single.*--weights-only"):
            checkpoint_convert.megatron_flags(payload, _megatron_run_args(**change))
    legacy = _megatron_run_args(legacy_tokenizer=True, tokenizer_type="SentencePieceTokenizer", tokenizer_model="m")
    with pytest.raises(ValueError, match=r"args.legacy_tokenizer=True.*<EOD>.*--weights-only"):
        checkpoint_convert.megatron_flags({**payload, "args": megatron_read.megatron_args_to_lite(legacy)}, legacy)


@pytest.mark.parametrize("key, value", [("layernorm_zero_centered_gamma", True), ("apply_layernorm_1p", True),
                                        ("softmax_type", "off-by-one"), ("window_size", (128, 0)),
                                        ("attention_output_gate", True), ("no_rope_freq", 4),
                                        ("rotary_seq_len_interpolation_factor", 2), ("softmax_scale", 0.5)])
def test_megatron_core_forward_options_gpt_model_lacks_are_refused(key, value):
    """megatron-core 0.16.1 TransformerConfig fields (Megatron-LM args of the same name) that change the forward
    pass: --apply-layernorm-1p stores each norm's weight minus one, a sliding window, an off-by-one softmax, an
    attention output gate, layers without rope, an interpolated rope, another softmax scale. Each is refused
    naming the arg; converted, the model would silently compute something else. The defaults convert."""
    with pytest.raises(ValueError, match=f"args.{key}="):
        megatron_read.megatron_args_to_lite(_megatron_run_args(**{key: value}))
    megatron_read.megatron_args_to_lite(_megatron_run_args(softmax_scale=(32 // 4) ** -0.5, softmax_type="vanilla"))


def test_no_pickled_call_runs_whatever_it_names(tmp_path):
    """torch.save'd objects whose unpickling would call os.system, builtins.eval / exec, subprocess.Popen,
    torch.save or io.open (each would create a file): foreign_pickle.load gives inert placeholders or refuses
    the file, and no file appears. Catches an allow-list that lets a callable through or a placeholder that
    calls what it stands for."""
    marker = str(tmp_path / "ran")
    traps = {"system": _Trap(os.system, f"touch {marker}-system"),
             "eval": _Trap(eval, f"open({marker + '-eval'!r}, 'w')"),
             "exec": _Trap(exec, f"open({marker + '-exec'!r}, 'w')"),
             "popen": _Trap(subprocess.Popen, ["touch", marker + "-popen"]),
             "save": _Trap(torch.save, 1, marker + "-save"), "open": _Trap(open, marker + "-open", "w")}
    for name, trap in traps.items():
        path = str(tmp_path / f"{name}.pt")
        torch.save({"args": argparse.Namespace(num_layers=1), "extra": trap}, path)
        try:
            loaded = foreign_pickle.load(path, path)
            assert isinstance(loaded["extra"], foreign_pickle.Placeholder), name
            assert loaded["args"].num_layers == 1
        except ValueError as e:
            assert "cannot be read" in str(e), name
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ran")]


@pytest.mark.parametrize("name", ["gpt2_torch", "gpt2_dist"])
def test_fused_adams_step_in_the_param_groups_is_read(megatron, tmp_path, name):
    """On a GPU Megatron-LM's Adam is Transformer Engine's (or apex's) FusedAdam, which counts the step in each
    param group, not per parameter; megatron-core then saves no per-parameter step (torch_dist: no common_step,
    optimizer.py _extract_common_per_param_step). This CPU run used torch's AdamW: its checkpoint is rewritten
    in FusedAdam's form. Every parameter must get the group's step, 3: with 0, Adam's bias correction starts
    over and the resumed updates are several times too large, silently."""
    import mcore_save as ms

    root = tmp_path / name
    shutil.copytree(os.path.join(megatron[0], name), root)
    path = root / "iter_0000003" / ("mp_rank_00/model_optim_rng.pt" if name == "gpt2_torch" else "common.pt")
    state = torch.load(path, weights_only=False)
    saved = state["optimizer"]
    steps = [entry.pop("step") for entry in saved["state"].values() if isinstance(entry, dict)]
    steps += [saved["state"].pop("common_step")] if "common_step" in saved["state"] else []
    assert steps and all(int(s) == ms.SAVE_AT for s in steps)
    for group in saved["param_groups"]:
        group["step"] = ms.SAVE_AT
    torch.save(state, path)
    payload, _ = megatron_read.read_megatron(str(root))
    assert {entry["step"] for entry in payload["optimizer"]["state"].values()} == {ms.SAVE_AT}


def test_param_groups_with_their_own_learning_rate_are_refused(megatron, tmp_path, capsys):
    """megatron-core's scheduler gives each param group its own max_lr / min_lr (--decoupled-lr, param-group
    overrides); megatron-lite's one schedule times lr_mult cannot continue that: refused naming max_lr and the
    remedy, not resumed with the main learning rate for every parameter."""
    def decoupled(state):
        state["optimizer"]["param_groups"][1]["max_lr"] = 2 * state["optimizer"]["param_groups"][1]["max_lr"]

    source = _legacy_copy(megatron, tmp_path / "a", decoupled)
    err = refused(capsys, "--from", "megatron", "--input", source, "--output", str(tmp_path / "a" / "c"))
    assert "max_lr" in err and "--weights-only" in err


def test_optimizer_fields_it_does_not_convert_are_refused(megatron, tmp_path, capsys):
    """An Adam state with fields beyond exp_avg / exp_avg_sq / step / the main params (Transformer Engine's
    FusedAdam with --use-precision-aware-optimizer keeps the fp32 master values as 'master_param', amsgrad its
    max_exp_avg_sq) is refused naming the field, not converted without it (the bf16 weights taken as the mains)."""
    def precision_aware(state):
        entry = state["optimizer"]["state"][0]
        entry["master_param"] = entry["exp_avg"].clone()

    source = _legacy_copy(megatron, tmp_path / "a", precision_aware)
    err = refused(capsys, "--from", "megatron", "--input", source, "--output", str(tmp_path / "a" / "c"))
    assert "master_param" in err and "--weights-only" in err


def test_a_megatron_lite_checkpoint_given_to_from_megatron_is_named(tmp_path):
    """--from megatron on megatron-lite's own --save directory said only 'not a Megatron-LM checkpoint': the
    refusal names what it is (its manifest.json) and the remedy; another directory gets the right --input."""
    own = tmp_path / "lite" / "iter_0000006"
    own.mkdir(parents=True)
    (own / files.MANIFEST_FILENAME).write_text("{}")
    (tmp_path / "lite" / files.TRACKER_FILENAME).write_text("6")
    with pytest.raises(ValueError, match=r"megatron-lite's own \(manifest.json\).*pretrain_gpt.py --load"):
        megatron_read.find_checkpoint(str(tmp_path / "lite"))
    (tmp_path / "other" / "iter_0000001").mkdir(parents=True)
    with pytest.raises(ValueError, match="give --input a Megatron-LM --save directory"):
        megatron_read.find_checkpoint(str(tmp_path / "other" / "iter_0000001"))
