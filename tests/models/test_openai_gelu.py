"""GPTConfig.activation_func='openai_gelu' (Megatron's --openai-gelu: GELU's tanh approximation): the function
against megatron-core's openai_gelu, torch's gelu(approximate='tanh') and the formula; megatron-core's GPTModel with
that activation on the same weights; transformers' names of the same formula (GPT-2's 'gelu_new', ...) imported by
tools/checkpoint_convert.py --from hf and exported back as 'gelu_new'; the flag through pretrain_gpt.py."""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from distributed_helper import run_distributed
from mcore_reference import requires_mcore, run_script
from pretrain_testing import REPO, pretrain_outcome, tiny_pretrain_flags

from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.models.gpt import openai_gelu

sys.path.insert(0, os.path.join(REPO, "tools"))
import hf_convert  # noqa: E402

EPS = torch.finfo(torch.float32).eps


def _inputs():
    return torch.cat([torch.linspace(-12, 12, 240001), torch.randn(100000, generator=torch.Generator().manual_seed(0))])


def _rounding(y):
    """What two fp32 evaluations of one formula may differ by: a few units in the last place of the result."""
    return 4 * EPS * y.abs().clamp_min(1.0)


def test_openai_gelu_is_the_tanh_formula_and_torchs_tanh_gelu():
    """Would catch another activation behind the name (the exact erf GELU differs by up to 4.7e-4, a sigmoid
    approximation by 2e-2) or a wrong constant (sqrt(2/pi), 0.044715)."""
    x = _inputs()
    y = openai_gelu(x)
    x64 = x.double()
    formula = 0.5 * x64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert ((y.double() - formula).abs() <= _rounding(formula)).all()
    assert torch.equal(y, F.gelu(x, approximate="tanh"))
    assert (y - F.gelu(x)).abs().max().item() > 1e-4
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                               max_position_embeddings=4, activation_func="openai_gelu"))
    assert model.layers[0].mlp.activation is openai_gelu
    with pytest.raises(ValueError, match="activation_func must be one of .*'openai_gelu'"):
        GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, max_position_embeddings=4,
                  activation_func="gelu_new")


@requires_mcore
def test_megatron_core_openai_gelu_and_gpt_model_agree():
    """megatron-core's openai_gelu (its torch.compile'd expression) within one unit in the last place of
    megatron-lite's, and its GPTModel with activation_func=openai_gelu on megatron-lite's weights (mapped by
    megatron_lm.state_to_megatron) within 1e-6 of megatron-lite's logits. Would catch a model whose 'openai_gelu'
    is not Megatron's: the exact GELU's logits are 8e-5 away from megatron-core's on these weights."""
    result = run_script("mcore_openai_gelu.py")
    assert result["activation"] <= EPS * result["largest"], result
    assert result["logits"] < 1e-6, result
    assert result["logits_exact_gelu"] > 1e-5, result
    # Megatron-LM's default core GPT (F.gelu, bias_gelu_fusion on, biases) computes this tanh form, not the exact
    # GELU: would catch docs, an import or an export that take a core run without --openai-gelu as exact GELU.
    assert result["fused_logits"] < 1e-6, result
    assert result["fused_logits_exact_gelu"] > 1e-5, result


# ------------------------------------------------------------------------------------------ transformers
def test_transformers_names_of_the_formula_are_the_ones_imported():
    """Every activation of transformers' ACT2FN within fp32 rounding of openai_gelu is in hf_convert.TANH_GELU,
    and every name there is (measured, not read from the source). Would catch an import accepting an activation
    that is not the formula, or refusing one that is (e.g. a name transformers adds)."""
    activations = pytest.importorskip("transformers.activations")
    x = _inputs()
    y = openai_gelu(x)
    same = set()
    for name in activations.ACT2CLS:
        try:
            theirs = activations.ACT2FN[name](x)
        except Exception:  # an activation needing arguments or hardware: not a drop-in GELU either
            continue
        if theirs.shape == y.shape and ((theirs - y).abs() <= _rounding(y)).all():
            same.add(name)
    assert same == set(hf_convert.TANH_GELU) & set(activations.ACT2CLS), same
    assert "gelu_new" in same and "gelu" not in same


def _hf_gpt2(directory, activation):
    """A transformers GPT2LMHeadModel with this activation, weights of std 0.3 (norms near 1), saved to
    `directory` (safetensors; config.json without activation_function when `activation` is None)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config = transformers.GPT2Config(vocab_size=300, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                     **({"activation_function": activation} if activation else {}))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(directory))
    if activation is None:
        path = directory / "config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                    if k != "activation_function"}))
    return model


@pytest.mark.parametrize("activation", [*hf_convert.TANH_GELU, None])
def test_gpt2_with_a_tanh_gelu_imports_as_openai_gelu_and_exports_as_gelu_new(tmp_path, activation, capsys):
    """checkpoint_convert.py --from hf of a GPT-2 with each name of the tanh GELU (None: config.json without
    activation_function, whose transformers default is 'gelu_new'): the checkpoint records openai_gelu, the
    printed command has --openai-gelu, GPTModel's fp32 logits within 1e-5 of transformers' (1e-3 off with the
    exact GELU: the check can fail); exported back it is 'gelu_new' with transformers' logits. Would catch a
    tanh GELU imported as the exact one, or the export writing 'gelu' for a model trained with --openai-gelu."""
    import checkpoint_convert

    if activation is not None and activation not in __import__("transformers.activations").activations.ACT2CLS:
        pytest.skip(f"this transformers has no {activation!r}")
    hf = _hf_gpt2(tmp_path / "hf", activation)
    checkpoint_convert.main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")])
    assert "--openai-gelu" in capsys.readouterr().out
    iteration, directory = checkpoint_convert.files.find_latest(str(tmp_path / "ckpt"))
    payload = checkpoint_convert.read(directory)
    assert payload["args"]["openai_gelu"] is True
    config = hf_convert.gpt_config(payload["args"])
    assert config.activation_func == "openai_gelu"
    ours = GPTModel(config).eval()
    ours.load_state_dict(payload["model"])
    exact = GPTModel(GPTConfig(**{**config.__dict__, "activation_func": "gelu"})).eval()
    exact.load_state_dict(payload["model"])
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
        assert (ours(tokens)[..., :300] - theirs).abs().max().item() <= 1e-5
        assert (exact(tokens)[..., :300] - theirs).abs().max().item() > 1e-4
    payload["args"].update(tokenizer_type="NullTokenizer", vocab_size=300)
    exported = checkpoint_convert.export_hf(payload, str(tmp_path / "back"))
    assert exported["activation_function"] == "gelu_new"
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - theirs).abs().max().item() <= 1e-5


def test_other_gpt2_activations_are_refused_naming_the_imported_ones():
    """Would catch an activation GPTModel does not compute imported as if it were one it does."""
    with pytest.raises(ValueError, match=r"activation_function='quick_gelu' cannot be imported: .*'gelu_new'"):
        hf_convert.from_hf({"model_type": "gpt2", "activation_function": "quick_gelu"}, {})


# ------------------------------------------------------------------------------------------ pretrain_gpt.py
def test_flag_in_help_and_refused_with_swiglu(capsys):
    """--openai-gelu is in --help; with --swiglu (two activations) it is a flag error naming both, on every rank
    (parse_args raises alike everywhere). Would catch Megatron-LM's core behaviour of silently taking SiLU."""
    from pretrain_testing import flag_error

    from megatron_lite.training import parse_args
    from megatron_lite.training.arguments import gpt_config_from_args

    with pytest.raises(SystemExit):
        parse_args(["--help"], world_size=1)
    assert "--openai-gelu" in capsys.readouterr().out
    assert "--openai-gelu and --swiglu" in flag_error(tiny_pretrain_flags(openai_gelu=True, swiglu=True), capsys)
    config = gpt_config_from_args(parse_args(tiny_pretrain_flags(openai_gelu=True), world_size=1), vocab_size=64)
    assert config.activation_func == "openai_gelu"


def test_pretrain_records_the_flag_and_a_resume_without_it_names_it(tmp_path):
    """A --openai-gelu run records openai_gelu in its checkpoint; resuming it without the flag (another model)
    is refused naming openai_gelu. Would catch the flag missing from the recorded architecture arguments."""
    save = tiny_pretrain_flags(train_iters="2", save=str(tmp_path), openai_gelu=True)
    status, losses = run_distributed(pretrain_outcome, 1, save)[0]
    assert status == "ok" and all(math.isfinite(v) for v in losses.values()), losses
    state = torch.load(str(tmp_path / "iter_0000002" / "common.pt"), weights_only=True)  # torch_dist
    assert state["args"]["openai_gelu"] is True
    status, message = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(train_iters="4", load=str(tmp_path)))[0]
    assert status == "error" and "openai_gelu=True, this run has openai_gelu=False" in message, message


def test_a_checkpoint_from_before_the_flag_resumes_only_without_it(tmp_path):
    """A checkpoint saved before openai_gelu was recorded (its args lack the key) was trained with the exact GELU:
    it resumes without --openai-gelu, and with it is refused naming openai_gelu. Would catch the missing key
    skipping the comparison (a silent switch of the activation mid-training)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    flags = dict(lr_decay_iters="4", ckpt_format="torch")
    status, losses = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(
        train_iters="2", save=str(tmp_path / "new"), **flags))[0]
    assert status == "ok", losses
    payload = checkpoint_convert.read(checkpoint_convert.files.find_latest(str(tmp_path / "new"))[1])
    assert payload["args"].pop("openai_gelu") is False
    checkpoint_convert.write(str(tmp_path / "old"), payload, "torch")
    status, message = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(
        train_iters="3", load=str(tmp_path / "old"), openai_gelu=True, **flags))[0]
    assert status == "error" and "openai_gelu=False, this run has openai_gelu=True" in message, message
    status, losses = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(
        train_iters="3", load=str(tmp_path / "old"), **flags))[0]
    assert status == "ok" and sorted(losses) == [3], losses
