"""The Llama-class options of GPTConfig (RMSNorm, SwiGLU, grouped-query attention, no linear biases) against
hand-written fp32 references, their FLOPs, their validation, the --model-preset llama-tiny and its training
through pretrain_gpt.py. The meta-device build of this configuration is in tests/distributed/test_meta_init.py.
"""

import math

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags

from megatron_lite.models import GPTConfig, GPTModel, num_floating_point_operations
from megatron_lite.models.gpt import MLP, SelfAttention, apply_rotary, norm, rotary_cos_sin

TOL = dict(rtol=1e-6, atol=1e-6)


def llama_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func="silu", num_query_groups=2,
                  add_bias_linear=False, position_embedding_type="rope", share_embeddings_and_output_weights=False)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def randomize(module, seed=0):
    """Non-trivial values everywhere (norm weights too), so a skipped weight or bias shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


# ------------------------------------------------------------------------ plain references (fp32, by hand)
def ref_rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def ref_swiglu_mlp(x, fc1, fc2, ffn):
    hidden = x @ fc1.T
    gate, up = hidden[..., :ffn], hidden[..., ffn:]  # Megatron's order: act(first half) * second half
    return (gate * torch.sigmoid(gate) * up) @ fc2.T


def ref_attention(x, qkv_weight, proj_weight, heads, groups, rotary=None):
    """Causal attention, one query head at a time; head i reads key/value group i // (heads / groups)."""
    b, s, h = x.shape
    d = h // heads
    q_all, k_all, v_all = (x @ qkv_weight.T).split([h, groups * d, groups * d], dim=-1)
    mask = torch.ones(s, s).tril().bool()
    outs = []
    for i in range(heads):
        g = i // (heads // groups)
        q, k, v = q_all[..., i * d:(i + 1) * d], k_all[..., g * d:(g + 1) * d], v_all[..., g * d:(g + 1) * d]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        outs.append(torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ v)
    return torch.cat(outs, dim=-1) @ proj_weight.T


def ref_llama_forward(model, input_ids):
    """The whole model from its weights: RMSNorm, rotary GQA, SwiGLU, no biases, an untied output layer."""
    c = model.config
    s = input_ids.shape[1]
    rotary = rotary_cos_sin(torch.arange(s), c.hidden_size // c.num_attention_heads, c.rotary_base)
    x = model.word_embeddings.weight[input_ids]
    for layer in model.layers:
        a = layer.self_attention
        x = x + ref_attention(ref_rms_norm(x, layer.input_layernorm.weight, c.layernorm_epsilon),
                              a.linear_qkv.weight, a.linear_proj.weight, c.num_attention_heads, c.num_query_groups,
                              rotary)
        x = x + ref_swiglu_mlp(ref_rms_norm(x, layer.pre_mlp_layernorm.weight, c.layernorm_epsilon),
                               layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight, c.ffn_hidden_size)
    return ref_rms_norm(x, model.final_layernorm.weight, c.layernorm_epsilon) @ model.output_layer.weight.T


# ------------------------------------------------------------------------ forward against the references
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_rms_norm_matches_reference(eps):
    """Would catch a LayerNorm posing as RMSNorm (mean subtracted, a bias), eps added outside the square root
    (Megatron adds it inside; the large eps makes the difference visible), or eps ignored."""
    layer = randomize(norm(llama_config(layernorm_epsilon=eps)))
    assert isinstance(layer, torch.nn.RMSNorm) and [n for n, _ in layer.named_parameters()] == ["weight"]
    x = torch.randn(3, 5, 32) + 0.5
    torch.testing.assert_close(layer(x), ref_rms_norm(x, layer.weight, eps), **TOL)


def test_swiglu_mlp_matches_reference():
    """Would catch gate and up halves swapped, GELU instead of SiLU, the gate not multiplied in, a bias left in
    with add_bias_linear=False, or fc1 not twice ffn_hidden_size wide."""
    config = llama_config(ffn_hidden_size=24)
    mlp = randomize(MLP(config))
    assert mlp.linear_fc1.weight.shape == (48, 32) and mlp.linear_fc1.bias is None and mlp.linear_fc2.bias is None
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), ref_swiglu_mlp(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight, 24), **TOL)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("rope", [False, True])
def test_grouped_query_attention_matches_reference(groups, rope):
    """Would catch query heads mapped to the wrong key/value group (i % groups instead of i // (heads /
    groups)), k/v projections sized for all heads, rotary skipped on the grouped keys, or the causal mask lost."""
    attention = randomize(SelfAttention(llama_config(num_query_groups=groups)))
    assert attention.linear_qkv.weight.shape == (32 + 2 * groups * 8, 32)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(groups))
    rotary = rotary_cos_sin(torch.arange(7), 8) if rope else None
    expected = ref_attention(x, attention.linear_qkv.weight, attention.linear_proj.weight, 4, groups, rotary)
    # Two fp32 summation orders (SDPA's against the reference's) differ by about 1e-6 of the output's scale; a
    # wrong group, mask or rotation is of the order of the output itself.
    scale = expected.abs().max().item()
    torch.testing.assert_close(attention(x, rotary), expected, rtol=0, atol=2e-6 * scale)


def test_llama_model_matches_reference():
    """Would catch the options not reaching every layer (a LayerNorm left as the final norm, a bias kept, the
    tied matrix used as the output layer) or the blocks wired in another order."""
    torch.manual_seed(0)
    model = randomize(GPTModel(llama_config()))
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    ids = torch.randint(0, 64, (2, 9))
    logits = model(ids)
    # Two fp32 summation orders through two layers differ by about 1e-6 of the logits' scale (both are that
    # close to a float64 evaluation); a wiring error is of the order of the logits themselves.
    scale = logits.abs().max().item()
    torch.testing.assert_close(logits, ref_llama_forward(model, ids), rtol=0, atol=2e-6 * scale)


def test_as_many_groups_as_heads_is_multi_head_attention_bitwise():
    """num_query_groups == num_attention_heads (or None) must be today's multi-head attention exactly: same
    parameters from the same seed, same outputs bit for bit. Would catch another q/k/v layout in linear_qkv
    (checkpoints of today's GPT would load into the wrong heads) or a different attention kernel path."""
    def old_forward(attention, x):  # the multi-head forward before grouped-query attention existed
        b, s, h = x.shape
        q, k, v = attention.linear_qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attention.linear_proj(out.transpose(1, 2).reshape(b, s, h))

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16)
    models = []
    for groups in (None, 4):
        torch.manual_seed(3)
        models.append(GPTModel(GPTConfig(**base, num_query_groups=groups)))
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 64, (2, 12))
    assert torch.equal(models[0](ids), models[1](ids))
    x = torch.randn(2, 12, 32)
    attention = models[1].layers[0].self_attention
    assert torch.equal(attention(x, None), old_forward(attention, x))


# ------------------------------------------------------------------------ FLOPs, ffn default, validation
def test_flops_of_a_llama_config_by_hand():
    """Would catch a gated MLP counted with two matrices instead of three, or k/v projections counted at the
    full width under grouped-query attention. Hand count for h=32, 4 heads of 8, 2 groups, ffn 64, L=2, V=64,
    b=3, s=16 (T=48): per layer qkv 32*(32+2*16)=2048, proj 1024, MLP 3*32*64=6144; logits 32*64=2048;
    forward = 2*48*(2*9216 + 2048) + 2*2*2*3*16^2*32 = 2162688; step = 3x."""
    config = llama_config()
    assert config.ffn_hidden_size == 64
    assert num_floating_point_operations(config, 3, 16) == 3 * 2162688
    linear = sum(m.weight.numel() for m in GPTModel(config).modules() if isinstance(m, torch.nn.Linear))
    assert num_floating_point_operations(config, 3, 16) == 3 * (2 * 48 * linear + 2 * 4 * 3 * 16 * 16 * 32)


def test_swiglu_ffn_default_is_megatrons_rule():
    """Would catch 4h kept for a gated MLP (half again the parameters), or another rounding than Megatron's
    int(4h * 2/3 / 64) * 64; an explicit ffn_hidden_size must win."""
    shape = dict(num_layers=1, num_attention_heads=4, vocab_size=8, max_position_embeddings=8)
    assert GPTConfig(hidden_size=4096, gated_linear_unit=True, **shape).ffn_hidden_size == 10880
    assert GPTConfig(hidden_size=128, gated_linear_unit=True, **shape).ffn_hidden_size == 320
    assert GPTConfig(hidden_size=128, **shape).ffn_hidden_size == 512
    assert GPTConfig(hidden_size=128, gated_linear_unit=True, ffn_hidden_size=100, **shape).ffn_hidden_size == 100
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        GPTConfig(hidden_size=16, gated_linear_unit=True, **shape)  # the rule gives 0 below hidden 24


@pytest.mark.parametrize("bad, field", [
    (dict(num_query_groups=3), "num_query_groups"),
    (dict(num_query_groups=0), "num_query_groups"),
    (dict(normalization="rmsnorm"), "normalization"),
    (dict(activation_func="relu"), "activation_func"),
    (dict(gated_linear_unit="yes"), "gated_linear_unit"),
    (dict(add_bias_linear=None), "add_bias_linear"),
])
def test_invalid_llama_options_name_the_field(bad, field):
    """Would catch a group count that does not divide the heads reaching the model (a reshape error or a silent
    wrong mapping), or a misspelled option silently falling back to the default."""
    with pytest.raises(ValueError, match=field):
        llama_config(**bad)


@pytest.mark.parametrize("argv, message", [
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-attention-heads (4) must be divisible by "
                                                             "--num-query-groups (3)"),
    (["--normalization", "RMS"], "invalid choice"),
])
def test_invalid_llama_flags_name_the_flag(argv, message, capsys):
    """Would catch --num-query-groups silently ignored without --group-query-attention (Megatron's behaviour,
    which trains another model than asked), or an error that names the config field instead of the flag."""
    from megatron_lite.training import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--num-attention-heads", "4"] + argv, world_size=1)
    assert message in capsys.readouterr().err


def test_llama_tiny_preset_builds_a_llama_config():
    """Would catch a preset switch that never reaches GPTConfig (e.g. --swiglu without silu, biases kept), or a
    preset overriding a flag that was given; --group-query-attention alone means one group (Megatron's)."""
    from megatron_lite.training import parse_args
    from megatron_lite.training.arguments import gpt_config_from_args

    c = gpt_config_from_args(parse_args(["--model-preset", "llama-tiny"], world_size=1), vocab_size=256)
    assert (c.normalization, c.gated_linear_unit, c.activation_func, c.num_query_groups, c.add_bias_linear,
            c.position_embedding_type, c.share_embeddings_and_output_weights, c.ffn_hidden_size) == (
        "RMSNorm", True, "silu", 2, False, "rope", False, 320)
    c = gpt_config_from_args(parse_args(["--model-preset", "llama-tiny", "--normalization", "LayerNorm"],
                                        world_size=1), vocab_size=256)
    assert c.normalization == "LayerNorm" and c.gated_linear_unit
    c = gpt_config_from_args(parse_args(["--model-preset", "none", "--num-layers", "1", "--hidden-size", "32",
                                         "--num-attention-heads", "4", "--seq-length", "8", "--lr", "1e-3",
                                         "--micro-batch-size", "1", "--train-iters", "1", "--group-query-attention"],
                                        world_size=1), vocab_size=256)
    assert c.num_query_groups == 1 and c.normalization == "LayerNorm" and c.add_bias_linear


def test_llama_tiny_trains_through_pretrain_gpt():
    """Would catch a Llama-class model that fails somewhere in the real loop (DDP buckets over bias-free layers,
    the untied output layer, the FLOPs line) or does not learn: 2 ranks, 6 iterations, the loss must fall."""
    argv = tiny_pretrain_flags(model_preset="llama-tiny", num_attention_heads="4", lr="3e-3")
    losses = run_distributed(pretrain_losses, 2, argv)[0]
    values = [losses[i] for i in sorted(losses)]
    assert all(math.isfinite(v) for v in values) and values[-1] < values[0], losses


def _resume_message(argv):
    """pretrain_gpt.main on this rank; the ValueError's message, or None when it ran."""
    try:
        pretrain_losses(argv)
    except ValueError as e:
        return str(e)
    return None


def test_resuming_with_other_llama_options_names_the_option(tmp_path):
    """Would catch the Llama options missing from the checkpoint's recorded architecture arguments: a checkpoint
    loaded into a run with another --swiglu, --normalization, ... then fails on some parameter's shape or name
    deep in the load instead of naming the option to change."""
    save = tiny_pretrain_flags(train_iters="2", save=str(tmp_path))
    assert run_distributed(_resume_message, 1, save) == [None]
    for changed, key in ((dict(swiglu=True), "swiglu"), (dict(normalization="RMSNorm"), "normalization"),
                         (dict(disable_bias_linear=True), "disable_bias_linear"),
                         (dict(group_query_attention=True), "group_query_attention")):
        argv = tiny_pretrain_flags(train_iters="4", load=str(tmp_path), **changed)
        message = run_distributed(_resume_message, 1, argv)[0]
        assert message is not None and f"{key}=" in message, (changed, message)
