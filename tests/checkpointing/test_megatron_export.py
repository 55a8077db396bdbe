"""megatron-lite checkpoints -> Megatron-LM (megatron_lite/checkpointing/megatron_write.py, tools/checkpoint_convert.py
--to megatron): megatron-core 0.16.1 loads the exports as Megatron-LM does (torch_dist through dist_checkpointing.load
with its GPTModel's and optimizer's sharded_state_dict, strict; legacy through torch.load and load_state_dict(strict))
and gives megatron-lite's logits; with the optimizer state it trains on with megatron-lite's losses. GPT-2-class
(learned positions, LayerNorm, GELU, biases, tied) and Llama-class (GQA, untied, rope, RMSNorm, SwiGLU, no bias).

One megatron-core subprocess (tests/support/mcore_load_export.py) does every load; skipped where megatron-core is
not installed (pip install -e ".[megatron]")."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from distributed_helper import run_distributed
from mcore_reference import requires_mcore
from pretrain_testing import REPO

from megatron_lite.checkpointing import megatron_lm, megatron_write
from megatron_lite.models import GPTModel

sys.path.insert(0, os.path.join(REPO, "tools"))
import checkpoint_convert  # noqa: E402
import hf_convert  # noqa: E402

TOOL = os.path.join(REPO, "tools", "checkpoint_convert.py")
SCRIPT = os.path.join(REPO, "tests", "support", "mcore_load_export.py")
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128, max_position_embeddings=16,
            tokenizer_type="NullTokenizer", vocab_size=127)
LLAMA = dict(GPT2, hidden_size=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             group_query_attention=True, num_query_groups=2, disable_bias_linear=True, ffn_hidden_size=96,
             untie_embeddings_and_output_weights=True, norm_epsilon=1e-6, rotary_base=50000.0)
LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.95), 1e-8
SAVED_AT, CONTINUED = 5, 5  # iterations before the save, iterations after it (a 10-iteration run)
BATCH = 2  # the global batch: one micro-batch, DP 1 (megatron-core's and megatron-lite's steps are then one loss)
CONTINUATION_TOL = 5e-6
"""Losses after the move vs. megatron-lite's own continuation, about 10 fp32 ulps of a loss near 5 (measured: within
5e-7, one ulp). The two implementations compute the same fp32 math with different kernels (attention, cross entropy,
Adam's foreach vs. per-tensor updates): logits 1e-7 apart, and Adam's updates divide by sqrt(v) at every step. A
moved run without its Adam state (a fresh optimizer on the same weights) is ~3e-2 off: `fresh_losses`."""


def _batches(seed, count, vocab=128, shape=(BATCH, 16)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(count)]


def _lite_train(args, root, use_distributed_optimizer, ckpt_format, bf16=False):
    """A gloo rank: megatron-lite trains SAVED_AT iterations, saves, trains CONTINUED more; returns the losses."""
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.checkpointing import save_checkpoint
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    torch.manual_seed(1)
    model = GPTModel(hf_convert.gpt_config(args)).to(torch.bfloat16 if bf16 else torch.float32)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=bf16))
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=0.0,
        use_distributed_optimizer=use_distributed_optimizer, bf16=bf16), [ddp])
    sched = OptimizerParamScheduler(opt, LR, LR, 0, SAVED_AT + CONTINUED, "constant")
    losses = []
    for k, (ids, labels) in enumerate(_batches(7, SAVED_AT + CONTINUED)):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if k + 1 == SAVED_AT:
            save_checkpoint(root, SAVED_AT, ddp, opt, sched, SAVED_AT * BATCH, args=args, ckpt_format=ckpt_format)
    return losses


def _payload(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return checkpoint_convert.read(os.path.join(root, f"iter_{int(f.read()):07d}"))


def _logits(payload, probe):
    model = GPTModel(hf_convert.gpt_config(payload["args"])).eval()
    model.load_state_dict(payload["model"])
    with torch.no_grad():
        return model(probe)


# run: (recorded args, megatron-lite's distributed optimizer, megatron-lite's format, bf16)
RUNS = {"gpt2": (GPT2, False, "torch", False), "llama": (LLAMA, True, "torch_dist", False),
        "gpt2-bf16": (GPT2, False, "torch", True),
        "gpt2-openai-gelu": (dict(GPT2, openai_gelu=True), False, "torch", False)}
# loaded export: (run, --megatron-format, megatron-core's loader uses the distributed optimizer, legacy
# --megatron-transformer-impl). One torch_dist export per run serves both loaders.
EXPORTS = {"gpt2-torch_dist": ("gpt2", "torch_dist", False, None),
           "gpt2-legacy": ("gpt2", "torch", False, "local"),
           "llama-torch_dist": ("llama", "torch_dist", False, None),
           "llama-torch_dist-distopt": ("llama", "torch_dist", True, None),
           "llama-legacy": ("llama", "torch", False, "local"),
           "gpt2-openai-gelu-torch_dist": ("gpt2-openai-gelu", "torch_dist", False, None)}
"""gpt2-openai-gelu: megatron-core builds its MLP as Megatron-LM's flags make it (it ignores --openai-gelu): F.gelu
in the bias-GELU fusion, which computes GELU's tanh form."""
BF16_EXPORTS = {"gpt2-bf16-torch_dist": ("gpt2-bf16", "torch_dist", False, None),
                "gpt2-bf16-torch_dist-distopt": ("gpt2-bf16", "torch_dist", True, None),
                "gpt2-bf16-legacy": ("gpt2-bf16", "torch", False, "local")}
"""bf16 weights (Float16OptimizerWithFloat16Params' fp32 main params): loaded bitwise; logits and losses are not
compared (bf16 kernels of the two implementations round differently)."""


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """Every run trained and saved, every export written, and megatron-core's one process over all of them."""
    tmp = tmp_path_factory.mktemp("megatron_export")
    runs = {}
    for arch, (args, use_do, fmt, bf16) in RUNS.items():
        root = str(tmp / f"run_{arch}")
        losses = run_distributed(_lite_train, 1, args, root, use_do, fmt, bf16)[0]
        runs[arch] = {"losses": losses, "payload": _payload(root), "root": root}
    probe = _batches(3, 1)[0][0]
    continuation = _batches(7, SAVED_AT + CONTINUED)[SAVED_AT:]
    cases, printed = [], {}
    written = set()
    for name, (arch, fmt, use_do, impl) in {**EXPORTS, **BF16_EXPORTS}.items():
        out = str(tmp / f"{arch}-{fmt}")
        argv = ["--input", runs[arch]["root"], "--output", out, "--to", "megatron", "--megatron-format", fmt]
        argv += ["--megatron-transformer-impl", impl] if impl else []
        if out not in written:  # one export per run and format, loaded by every case that names it
            if name == "gpt2-torch_dist":  # the command line once, in a process of its own
                run = subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=120,
                                     cwd=REPO)
                assert run.returncode == 0, run.stdout + run.stderr
                printed[name] = run.stdout
            else:
                checkpoint_convert.main(argv)
            written.add(out)
        cases.append(_case(name, runs[arch]["payload"], out, fmt, use_do, probe,
                           continuation if name in EXPORTS else [], bf16=RUNS[arch][3]))
    # The regrouping skipped: a bridge that copies the fused QKV rows as they are.
    skipped = str(tmp / "llama-no-regrouping")
    original = megatron_write.qkv_to_megatron
    megatron_write.qkv_to_megatron = lambda tensor, heads, groups: tensor.clone()
    try:
        megatron_write.export(skipped, runs["llama"]["payload"])
    finally:
        megatron_write.qkv_to_megatron = original
    cases.append(_case("llama-no-regrouping", runs["llama"]["payload"], skipped, "torch_dist", False, probe, []))
    spec, result = str(tmp / "spec.pt"), str(tmp / "result.pt")
    torch.save({"cases": cases}, spec)
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, SCRIPT, spec, result], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return {"runs": runs, "probe": probe, "printed": printed, "mcore": torch.load(result, weights_only=False)}


def _case(name, payload, out, fmt, use_do, probe, batches, bf16=False):
    config = {k: v for k, v in vars(hf_convert.gpt_config(payload["args"])).items() if k != "params_dtype"}
    return {"name": name, "config": config, "checkpoint": os.path.join(out, f"iter_{SAVED_AT:07d}"), "format": fmt,
            "distributed_optimizer": use_do, "lr": LR, "weight_decay": WD, "betas": BETAS, "eps": EPS,
            "probe": probe, "batches": batches, "optimizer": True, "bf16": bf16}


@requires_mcore
@pytest.mark.parametrize("name", list(EXPORTS))
def test_megatron_core_loads_the_export_with_megatron_lite_logits(moved, name):
    """megatron-core's strict load of the export (every key its GPTModel and optimizer request is there, with the
    shapes it expects) gives the logits of megatron-lite's checkpoint. Would catch a wrong name or layout (layer
    axis, TE norm names, QKV order), a missing `_extra_state` object or an unstacked layer."""
    arch = EXPORTS[name][0]
    expected = _logits(moved["runs"][arch]["payload"], moved["probe"])
    assert (moved["mcore"][name]["logits"] - expected).abs().max().item() <= 1e-6


@requires_mcore
@pytest.mark.parametrize("name", list(EXPORTS) + list(BF16_EXPORTS))
def test_megatron_core_holds_the_checkpoints_weights_and_adam_state_bitwise(moved, name):
    """After megatron-core's load, every weight, fp32 main value, exp_avg and exp_avg_sq equals megatron-lite's
    (names mapped, QKV rows regrouped) bit for bit, and every parameter's step is the checkpoint's. Would catch
    state under another parameter's key, a dropped main copy (bf16) or a step count that is shared or lost."""
    arch = {**EXPORTS, **BF16_EXPORTS}[name][0]
    payload = moved["runs"][arch]["payload"]
    heads, groups = 4, (2 if arch == "llama" else 4)
    weights = megatron_lm.state_to_megatron(payload["model"], heads, groups)
    got = moved["mcore"][name]
    for key, tensor in got["weights"].items():
        if not key.endswith("_extra_state"):
            assert torch.equal(tensor, weights[key]), key
    state = payload["optimizer"]["state"]
    for field in ("param", "exp_avg", "exp_avg_sq"):
        expected = megatron_lm.state_to_megatron({n: e[field].reshape(payload["model"][n].shape)
                                                  for n, e in state.items()}, heads, groups)
        for key, tensors in got["optimizer_state"].items():
            assert torch.equal(tensors[field], expected[key].float().reshape(-1)), (field, key)
    steps = {int(tensors["step"].item()) for tensors in got["optimizer_state"].values()}
    assert steps == {SAVED_AT} and len(got["optimizer_state"]) == len(state)


@requires_mcore
def test_skipping_the_qkv_regrouping_loads_cleanly_and_computes_garbage(moved):
    """The trap the regrouping avoids: the rows copied as they are load without a missing or unexpected key and the
    logits are far off."""
    expected = _logits(moved["runs"]["llama"]["payload"], moved["probe"])
    assert (moved["mcore"]["llama-no-regrouping"]["logits"] - expected).abs().max().item() > 1e-2


@requires_mcore
@pytest.mark.parametrize("name", list(EXPORTS))
def test_megatron_core_continues_with_megatron_lite_losses(moved, name):
    """megatron-core with its own DDP and get_megatron_optimizer (AdamW, the same betas / eps / weight decay and
    exclusions, constant lr, no clipping) loads the Adam state and trains the batches megatron-lite trained after
    its save: the same losses within CONTINUATION_TOL; without the state they differ by far more. Would catch
    moments under the wrong key or QKV order, a lost step count (bias correction) or wrong param groups."""
    arch = EXPORTS[name][0]
    reference = moved["runs"][arch]["losses"][SAVED_AT:]
    got = moved["mcore"][name]
    assert max(abs(a - b) for a, b in zip(got["losses"], reference)) <= CONTINUATION_TOL, (got["losses"], reference)
    assert max(abs(a - b) for a, b in zip(got["fresh_losses"], reference)) > 1e-3


@requires_mcore
@pytest.mark.parametrize("name", list(EXPORTS) + list(BF16_EXPORTS))
def test_export_holds_the_keys_megatron_core_writes(moved, name):
    """torch_dist: the sharded keys megatron-core would save for this model and optimizer, plus Transformer Engine's
    core_attention `_extra_state` (which a TE model requests; an extra object is ignored by the load) and the other
    optimizer form's main values; legacy: the local spec's state_dict() keys exactly, in its order (which readers
    take the parameter order of the optimizer's ids from)."""
    got = moved["mcore"][name]
    _, fmt, use_do, _ = {**EXPORTS, **BF16_EXPORTS}[name]
    extra = set(got["written_keys"]) - set(got["expected_keys"])
    assert set(got["expected_keys"]) <= set(got["written_keys"])
    if fmt == "torch_dist":
        te_objects = {f"decoder.layers.self_attention.core_attention._extra_state/shard_{i}_2" for i in range(2)}
        other_form = "optimizer.state.fp32_param." if use_do else "optimizer.state.param."
        assert te_objects <= extra and all(k.startswith(other_form) for k in extra - te_objects), extra
    else:
        assert got["written_keys"] == got["expected_keys"]  # the order too: the optimizer's ids follow it


@requires_mcore
@pytest.mark.parametrize("name", list(EXPORTS))
def test_iteration_samples_scheduler_args_and_rng_as_megatron_lm_reads_them(moved, name):
    """The common state Megatron-LM's load_checkpoint reads: iteration, checkpoint_version 3.0, args with its names
    (check_checkpoint_args' fields, consumed_train_samples), the scheduler in SAMPLES (megatron-lite counts
    iterations), the distributed optimizer's sharding type in the content metadata, rank 0's CPU generators."""
    arch, fmt, use_do, _ = EXPORTS[name]
    payload = moved["runs"][arch]["payload"]
    common = moved["mcore"][name]["common"]
    args = common["args"]
    assert common["iteration"] == SAVED_AT and common["checkpoint_version"] == 3.0
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, payload["args"]["hidden_size"], 4)
    assert args.consumed_train_samples == SAVED_AT * BATCH and args.padded_vocab_size == 128
    assert args.ffn_hidden_size == (96 if arch == "llama" else 128)  # GPT2 records None: the size the model has
    assert args.add_position_embedding and args.swiglu == (arch == "llama")  # Megatron-LM's, also with rope
    sched = common["opt_param_scheduler"]
    assert sched["num_steps"] == SAVED_AT * BATCH and sched["lr_decay_steps"] == (SAVED_AT + CONTINUED) * BATCH
    assert sched["max_lr"] == LR and sched["lr_decay_style"] == "constant"
    if fmt == "torch_dist":  # read by Megatron-LM's load with --use-distributed-optimizer
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    rng = moved["mcore"][name]["rng"][0]
    assert torch.equal(rng["torch_rng_state"], payload["rng_state"][0]["torch"])
    assert tuple(rng["random_rng_state"][1]) == tuple(payload["rng_state"][0]["python"][1])


@requires_mcore
def test_tool_prints_the_megatron_lm_flags(moved):
    out = moved["printed"]["gpt2-torch_dist"]
    for flag in ("--ckpt-format torch_dist", "--num-layers 2", "--hidden-size 32", "--num-attention-heads 4",
                 "--use-checkpoint-opt_param-scheduler", "--no-load-rng", "--global-batch-size 2",
                 "--attention-dropout 0.0", "--hidden-dropout 0.0"):
        assert flag in out, out
    command = out.splitlines()[1]
    assert "--use-distributed-optimizer" not in command and "--swiglu" not in command
    assert "it loads with --use-distributed-optimizer too" in out
    assert "--no-bias-gelu-fusion" in out  # the exact GELU (Megatron-LM's default fusion computes the tanh form)
    assert "--tokenizer-type NullTokenizer --vocab-size 126" in out  # Megatron's adds the eod id: 127 ids here
    flags = megatron_write.megatron_flags(moved["runs"]["gpt2-openai-gelu"]["payload"], "out", "torch_dist",
                                          "transformer_engine", True)
    assert "--no-bias-gelu-fusion" not in flags


# ------------------------------------------------------------------------------------------ refusals
def _small_payload(**change):
    model = GPTModel(hf_convert.gpt_config(GPT2))
    payload = {"iteration": 1, "consumed_train_samples": 2, "model": model.state_dict(), "args": dict(GPT2),
               "optimizer": {"state": {}}, "opt_param_scheduler": {}, "rng_state": []}
    payload.update(change)
    return payload


def test_weights_only_export_needs_no_optimizer(tmp_path):
    """A checkpoint without Adam state (weights only, e.g. imported from Hugging Face) exports its weights, and the
    flags load it with --finetune."""
    info = megatron_write.export(str(tmp_path / "out"), _small_payload(), "torch", transformer_impl="local")
    assert info == {"optimizer": False, "global_batch_size": None}
    state = torch.load(tmp_path / "out" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert "optimizer" not in state and state["args"].no_save_optim
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert "--finetune" in megatron_write.megatron_flags(_small_payload(), "out", "torch", "local", False)


def test_a_weights_only_export_asks_for_megatron_lms_learning_rate(tmp_path, capsys):
    """Without the checkpoint's scheduler, Megatron-LM builds one from --lr, which has no default (None: its
    OptimizerParamScheduler's `max_lr >= min_lr` raises TypeError): the tool says to give it."""
    import argparse

    checkpoint_convert.export_megatron(_small_payload(), argparse.Namespace(
        output=str(tmp_path / "out"), megatron_format="torch_dist", megatron_transformer_impl="transformer_engine"))
    out = capsys.readouterr().out
    assert "--finetune" in out and "--lr at least" in out


@pytest.mark.parametrize("recorded, flags", [
    (dict(tokenizer_type="NullTokenizer", vocab_size=128), "--tokenizer-type NullTokenizer --vocab-size 127"),
    (dict(tokenizer_type="ByteLevelTokenizer"), "--tokenizer-type NullTokenizer --vocab-size 256"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json", merge_file="m.txt"),
     "--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="llama3"),
     "--tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3"),
    # megatron-core's AutoTokenizer.from_pretrained takes the directory (a file path: "Repo id must be in the
    # form ..."); megatron-lite reads the eos_token from that directory too
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/m/llama3/tokenizer.json"),
     "--tokenizer-type HuggingFaceTokenizer --tokenizer-model /m/llama3"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="t.model"),
     "--tokenizer-type Llama2Tokenizer --tokenizer-model t.model"),
    (dict(), ""),
])
def test_tokenizer_flags_give_the_runs_ids(recorded, flags):
    """Megatron-LM's NullTokenizer adds its end-of-document id after --vocab-size ids, megatron-lite's counts it
    (eod = vocab_size - 1); ByteLevelTokenizer's bytes and eod 256 are Megatron's NullTokenizer of 256."""
    assert " ".join(megatron_write.tokenizer_flags(recorded)) == flags


def test_legacy_uses_transformer_engine_names_by_default(tmp_path):
    """Megatron-LM's default --transformer-impl is transformer_engine: its norms live in linear_qkv / linear_fc1
    (a local-name file would load into a TE model with strict=False as Megatron-LM's fallback does: norms left
    at their initial values)."""
    megatron_write.export(str(tmp_path / "out"), _small_payload(), "torch")
    state = torch.load(tmp_path / "out" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in state["model"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_bias" in state["model"]
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in state["model"])
    assert "decoder.layers.1.self_attention.core_attention._extra_state" in state["model"]


_ADAM_WITH_AMSGRAD = {"optimizer": "adam", "grad_scaler": None, "param_groups": [
    {"wd_mult": 1.0, "lr_mult": 1.0, "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
     "amsgrad": True}],
    "state": {name: {"exp_avg": t, "exp_avg_sq": t, "max_exp_avg_sq": t, "step": 1}
              for name, t in GPTModel(hf_convert.gpt_config(GPT2)).state_dict().items()}}


@pytest.mark.parametrize("change, named", [
    (dict(expert_parallel={}), "expert parameters"),
    (dict(model={"encoder.weight": torch.zeros(2)}), "'encoder.weight'"),
    (dict(args={"hidden_size": 32}), "args lack"),
    (dict(args=dict(LLAMA, swiglu=False, openai_gelu=True)), "args.openai_gelu with disable_bias_linear"),
    (dict(optimizer=_ADAM_WITH_AMSGRAD), r"optimizer.param_groups set \['amsgrad'\]"),
])
def test_export_refuses_what_megatron_core_cannot_hold(tmp_path, change, named):
    with pytest.raises(ValueError, match=named):
        megatron_write.export(str(tmp_path / "out"), _small_payload(**change))
    assert not os.listdir(tmp_path)  # nothing written, no temporary left


def test_export_refuses_an_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="exists: choose a new directory"):
        megatron_write.export(str(tmp_path / "out"), _small_payload())
    assert os.listdir(tmp_path) == ["out"]


def test_tool_refuses_an_existing_output_and_megatron_flags_without_to_megatron(tmp_path, capsys):
    """Before any checkpoint is read: the output must be new; the --megatron-* flags belong to --to megatron."""
    (tmp_path / "out").mkdir()
    for argv, message in (
            (["--output", str(tmp_path / "out"), "--to", "megatron"], "exists: choose a new directory"),
            (["--output", str(tmp_path / "new"), "--to", "torch", "--megatron-format", "torch"], "need --to megatron")):
        with pytest.raises(SystemExit) as exc:
            checkpoint_convert.main(["--input", str(tmp_path / "missing"), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ round trip
def _trained_like_payload(args, bf16=False, seed=0):
    """A checkpoint payload with non-trivial values everywhere: weights, fp32 main values, moments, step 5, a
    cosine schedule in iterations, rank 0's generators; 5 iterations of a global batch of 4."""
    from megatron_lite.checkpointing.rng import get_rng_state

    g = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in GPTModel(hf_convert.gpt_config(args)).state_dict().items()}
    model = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    state = {k: {"param": v.clone(), "exp_avg": torch.randn(v.shape, generator=g) * 1e-2,
                 "exp_avg_sq": torch.rand(v.shape, generator=g) * 1e-4, "step": 5} for k, v in model.items()}
    groups = [{"wd_mult": m, "lr_mult": 1.0, "lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1 * m,
               "amsgrad": False, "maximize": False, "decoupled_weight_decay": True} for m in (1.0, 0.0)]
    return {"checkpoint_version": 2, "iteration": 5, "consumed_train_samples": 20,
            "model": {k: v.to(torch.bfloat16) if bf16 else v for k, v in model.items()},
            "optimizer": {"optimizer": "adam", "param_groups": groups, "grad_scaler": None, "state": state},
            "opt_param_scheduler": {"max_lr": 3e-3, "min_lr": 3e-4, "lr_warmup_steps": 2, "lr_decay_steps": 10,
                                    "lr_decay_style": "cosine", "num_steps": 5},
            "rng_state": [get_rng_state()], "args": dict(args)}


@pytest.mark.parametrize("fmt, impl", [("torch_dist", "transformer_engine"), ("torch", "local"),
                                       ("torch", "transformer_engine")])
@pytest.mark.parametrize("arch, bf16", [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_export_then_import_gives_the_checkpoint_back(tmp_path, fmt, impl, arch, bf16):
    """megatron_write then megatron_read (tools/checkpoint_convert.py --to megatron, then --from megatron): the
    weights, fp32 main values, moments and step bit for bit, the schedule in iterations again, iteration, consumed
    samples, rank 0's generators and the architecture. Needs no megatron-core. Would catch either side changing
    a name, the QKV order, the samples/iterations conversion or the optimizer's layout without the other."""
    from megatron_lite.checkpointing import megatron_read

    payload = _trained_like_payload(GPT2 if arch == "gpt2" else LLAMA, bf16)
    megatron_write.export(str(tmp_path / "out"), payload, fmt, impl)
    back, _ = megatron_read.read_megatron(str(tmp_path / "out"))
    assert set(back["model"]) == set(payload["model"]) - ({"output_layer.weight"} if arch == "gpt2" else set())
    assert all(torch.equal(back["model"][k], payload["model"][k]) for k in back["model"])
    state = back["optimizer"]["state"]
    assert set(state) == set(payload["optimizer"]["state"])
    for name, entry in payload["optimizer"]["state"].items():
        for field in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][field].reshape(entry[field].shape), entry[field]), (name, field)
        assert int(state[name]["step"]) == 5
    assert back["opt_param_scheduler"] == payload["opt_param_scheduler"]
    assert (back["iteration"], back["consumed_train_samples"]) == (5, 20)
    assert torch.equal(back["rng_state"][0]["torch"], payload["rng_state"][0]["torch"])
    for key, value in payload["args"].items():
        if key not in ("vocab_size", "tokenizer_type"):
            assert back["args"].get(key) == value, key


# ------------------------------------------------------------------------------------------ Megatron-LM's load
def _megatron_lm_args(flags):
    """The fields Megatron-LM 0.16.1's check_checkpoint_args (megatron/training/checkpointing.py) compares, as its
    parser gives them for `flags` (megatron/training/arguments.py: the defaults where the flags say nothing;
    padded_vocab_size by its _vocab_size_with_padding, the NullTokenizer's eod after --vocab-size ids)."""
    def value(flag, default=None):
        return flags[flags.index(flag) + 1] if flag in flags else default

    divisor = int(value("--make-vocab-size-divisible-by", 128))
    vocab = int(value("--vocab-size")) + 1 if value("--tokenizer-type") == "NullTokenizer" else None
    return {"num_layers": int(value("--num-layers")), "hidden_size": int(value("--hidden-size")),
            "num_attention_heads": int(value("--num-attention-heads")),
            "add_position_embedding": "--no-position-embedding" not in flags,
            "max_position_embeddings": int(value("--max-position-embeddings")),
            "make_vocab_size_divisible_by": divisor,
            "padded_vocab_size": vocab and -(-vocab // divisor) * divisor,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_printed_flags_pass_megatron_lms_checkpoint_args_check(fmt, arch):
    """Megatron-LM's load_checkpoint asserts that the checkpoint's args equal the run's for these fields
    (add_position_embedding always, whatever the position embedding type: a rope run's is True, as Megatron-LM
    saves it); the printed flags must give the recorded values."""
    payload = _trained_like_payload(GPT2 if arch == "gpt2" else LLAMA)
    flags = megatron_write.megatron_flags(payload, "out", fmt, "transformer_engine", True)
    saved = vars(megatron_write.megatron_args(payload, fmt, True))
    expected = _megatron_lm_args(flags)
    assert {k: saved[k] for k in expected} == expected


@pytest.mark.parametrize("precision, scaler, flag", [
    ("fp16", {"scale": 1024.0}, ["--loss-scale", "1024.0"]),  # ConstantGradScaler: Megatron's state is {}
    ("bf16", {"scale": 1024.0}, ["--loss-scale", "1024.0"]),
    ("fp16", {"scale": 4096.0, "growth_tracker": 3, "hysteresis_tracker": 2}, []),  # dynamic: the state has it
])
def test_a_constant_loss_scale_is_given_as_megatron_lms_flag(precision, scaler, flag):
    """A run with --loss-scale: Megatron-LM's ConstantGradScaler saves and loads {} and is built only from
    --loss-scale; without the flag an fp16 run builds a DynamicGradScaler whose load of {} raises KeyError
    ('scale': load_checkpoint stops), a bf16 one no scaler at all."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    payload = _trained_like_payload(GPT2)
    payload["model"] = {k: v.to(dtype) for k, v in payload["model"].items()}
    payload["optimizer"]["grad_scaler"] = scaler
    flags = megatron_write.megatron_flags(payload, "out", "torch_dist", "transformer_engine", True)
    assert f"--{precision}" in flags
    at = flags.index("--loss-scale") if "--loss-scale" in flags else None
    assert (flags[at:at + 2] if at is not None else []) == flag
