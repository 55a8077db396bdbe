"""GPTModel: shapes, causality, tied embeddings, rotary, dtypes, config, FLOPs; and a tied-embedding GPT
trained by DDP + the distributed optimizer on 2 ranks vs torch.optim.AdamW on the global batch.

The 2-rank comparison is not bit-exact, so it allows 1e-5 relative: the reference runs one forward over
the global batch (different matmul / mean reduction order than two half batches whose means are averaged
by the reduce-scatter), and the distributed optimizer sums squares per shard for the grad norm.
"""

import ast
import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from distributed_helper import run_distributed

from megatron_lite.models import GPTConfig, GPTModel, num_floating_point_operations
from megatron_lite.models import gpt as gpt_module
from megatron_lite.models.gpt import apply_rotary, rotary_cos_sin

VOCAB, SEQ, BATCH, HIDDEN = 64, 12, 4, 32


def tiny_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=16)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPTModel(tiny_config(**overrides))


def global_batch(step=0):
    """(input_ids, labels) [BATCH, SEQ]: the same on every rank, each rank takes its own rows."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


POSITION_TYPES = ["learned", "rope"]


# ---------------------------------------------------------------------------------- single process
@pytest.mark.parametrize("pe", POSITION_TYPES)
def test_shapes_and_dtypes(pe):
    """Would catch a head split/merge that scrambles [b, s, h] (wrong shape) or a loss not in fp32."""
    model = tiny_model(position_embedding_type=pe)
    ids, labels = global_batch()
    logits = model(ids)
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.dtype == torch.float32
    losses = model(ids, labels)
    assert losses.shape == (BATCH, SEQ) and losses.dtype == torch.float32
    assert torch.isfinite(losses).all()
    assert model(ids[:, :1]).shape == (BATCH, 1, VOCAB)  # shorter sequences than the maximum work too


@pytest.mark.parametrize("pe", POSITION_TYPES)
def test_causal(pe):
    """Would catch a missing causal mask (is_causal dropped) or a sequence/head transpose mixing positions:
    changing token t must leave the logits at positions < t untouched and change those at >= t."""
    model = tiny_model(position_embedding_type=pe)
    ids, _ = global_batch()
    t = 5
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-6


def test_sequence_longer_than_max_positions_is_rejected():
    """Would catch learned position embeddings indexed out of range (IndexError deep inside) or rope
    silently extrapolating past the configured maximum."""
    for pe in POSITION_TYPES:
        with pytest.raises(ValueError, match="max_position_embeddings"):
            tiny_model(position_embedding_type=pe)(torch.zeros(1, 17, dtype=torch.long))


def test_tied_embedding_is_one_parameter_used_by_the_output(monkeypatch):
    """Would catch a second registered Parameter for the output layer (a copy that DDP/optimizer would
    treat as a separate weight, or the same tensor registered twice) and an output projection that does
    not read the embedding matrix."""
    model = tiny_model()
    emb = model.word_embeddings.weight
    every = list(model.named_parameters(remove_duplicate=False))
    assert len(every) == len(list(model.parameters())) == len({id(p) for _, p in every})
    assert sum(p is emb for _, p in every) == 1
    assert not any("output" in name for name, _ in every)
    seen = []
    real_linear = F.linear

    def spy(x, weight, bias=None):
        seen.append(weight.data_ptr())
        return real_linear(x, weight, bias)

    monkeypatch.setattr(gpt_module.F, "linear", spy)
    model(global_batch()[0])
    assert seen[-1] == emb.data_ptr()  # the logits are the last matmul


def test_untied_output_layer_and_tied_gradient_sums_both_uses():
    """Would catch share_embeddings_and_output_weights=False still tying (no extra weight), an output
    bias, and a tied weight whose gradient misses one of its two uses (e.g. a detached output weight)."""
    tied = tiny_model()
    untied = tiny_model(share_embeddings_and_output_weights=False)
    names = {n for n, _ in untied.named_parameters()} - {n for n, _ in tied.named_parameters()}
    assert names == {"output_layer.weight"}
    assert untied.output_layer.bias is None and untied.output_layer.weight.shape == (VOCAB, HIDDEN)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == VOCAB * HIDDEN
    # Same values in both uses: the tied gradient is the sum of the untied model's two gradients.
    untied.load_state_dict({**tied.state_dict(), "output_layer.weight": tied.word_embeddings.weight.detach()})
    ids, labels = global_batch()
    tied(ids, labels).mean().backward()
    untied(ids, labels).mean().backward()
    expected = untied.word_embeddings.weight.grad + untied.output_layer.weight.grad
    torch.testing.assert_close(tied.word_embeddings.weight.grad, expected, rtol=1e-5, atol=1e-7)


def test_loss_is_cross_entropy_of_the_logits():
    """Would catch labels shifted inside the model, a mean instead of per-token losses, or a loss taken
    from differently computed logits."""
    model = tiny_model()
    ids, labels = global_batch()
    logits = model(ids)
    expected = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(model(ids, labels), expected.view(BATCH, SEQ), rtol=0, atol=0)


def test_position_embedding_parameters():
    """Would catch rope models still carrying (unused, never-updated) learned position embeddings, or
    learned models missing them."""
    learned = dict(tiny_model(position_embedding_type="learned").named_parameters())
    rope = dict(tiny_model(position_embedding_type="rope").named_parameters())
    assert learned["position_embeddings.weight"].shape == (16, HIDDEN)
    assert not any("position" in name for name in rope)
    assert set(learned) - set(rope) == {"position_embeddings.weight"}


def test_rotary_scores_depend_only_on_relative_position():
    """Would catch a wrong rotation (pairs mixed inconsistently, sin sign flipped, frequencies per
    position instead of per channel): q_m . k_n must be unchanged when every position shifts by 7."""
    g = torch.Generator().manual_seed(0)
    head_dim, s = 8, 6
    q, k = torch.randn(2, 3, s, head_dim, generator=g), torch.randn(2, 3, s, head_dim, generator=g)

    def scores(offset):
        cos, sin = rotary_cos_sin(torch.arange(s) + offset, head_dim)
        return apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2)

    torch.testing.assert_close(scores(7), scores(0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scores(0), q @ k.transpose(-1, -2), atol=1e-3)  # it does rotate
    cos, sin = rotary_cos_sin(torch.arange(s), head_dim)
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(dim=-1), q.norm(dim=-1))  # a rotation
    torch.testing.assert_close(apply_rotary(q, cos, sin)[..., 0, :], q[..., 0, :])  # identity at position 0


@pytest.mark.parametrize("pe", POSITION_TYPES)
def test_bf16_params(pe):
    """Would catch parameters created in fp32 and cast later (or not at all), and a forward that breaks
    on bf16 (e.g. rotary tables or the loss in the wrong dtype)."""
    model = tiny_model(position_embedding_type=pe, params_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids, labels = global_batch()
    assert model(ids).dtype == torch.bfloat16
    losses = model(ids, labels)
    assert losses.dtype == torch.float32 and torch.isfinite(losses).all()
    losses.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_megatron_init():
    """Would catch the depth-scaled init missing on the residual output projections (or applied to the
    wrong Linears), non-zero biases, and LayerNorms not starting as identity."""
    layers = 4
    model = tiny_model(num_layers=layers, hidden_size=64, init_method_std=0.05)
    scaled = 0.05 / math.sqrt(2 * layers)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "layernorm" in name:
            assert torch.all(p == 1), name
        else:
            std = scaled if ("linear_proj" in name or "linear_fc2" in name) else 0.05
            assert abs(p.std().item() / std - 1) < 0.1, (name, p.std().item(), std)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(hidden_size=-8), "hidden_size"),
        (dict(num_attention_heads=5), "divisible"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(position_embedding_type="rope", hidden_size=36, num_attention_heads=4), "head dim"),
        (dict(rotary_base=0.0), "rotary_base"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(init_method_std=0.0), "init_method_std"),
        (dict(layernorm_epsilon=0.0), "layernorm_epsilon"),
        (dict(params_dtype=torch.int32), "params_dtype"),
    ],
)
def test_config_validation(overrides, field):
    """Would catch invalid shapes reaching the model (cryptic view/reshape errors) instead of a
    ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_config_defaults():
    assert tiny_config().ffn_hidden_size == 4 * HIDDEN
    assert tiny_config(ffn_hidden_size=40).ffn_hidden_size == 40


def test_model_imports_torch_only():
    """Would catch the model growing a dependency on torch.distributed or on the rest of megatron_lite
    (the model must know nothing about distribution; DDP wraps it from outside)."""
    source = inspect.getsource(gpt_module)
    assert "distributed" not in source.replace("knows nothing about distribution", "")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            imported.add(node.module)
    assert {m.split(".")[0] for m in imported} <= {"torch", "math", "dataclasses", "typing", "types"}, imported
    assert not any(m.startswith("torch.distributed") for m in imported)


def test_flops_formula():
    """Would catch a FLOPs count that drifts from the model: the matmul term must equal 2 x (weights of
    every Linear) per token, and the total must reduce to Megatron's closed form for ffn = 4h."""
    cfg = tiny_config(share_embeddings_and_output_weights=False)
    model = GPTModel(cfg)
    b, s = 3, 16
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = cfg.num_layers * 4 * b * s * s * cfg.hidden_size
    assert num_floating_point_operations(cfg, b, s) == 3 * (2 * b * s * linear_weights + attention)
    L, h, V, T = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, b * s
    megatron = 72 * T * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert num_floating_point_operations(cfg, b, s) == pytest.approx(megatron, rel=1e-12)


# ---------------------------------------------------------------------------------- 2 gloo ranks
LR, WD, CLIP, STEPS, BUCKET_SIZE = 1e-3, 0.1, 1.0, 3, 4000


def global_batch_grads(model, ids, labels, dp=1):
    """Gradient of the mean loss over the global batch, by name: in one pass (dp=1), or as the mean of the
    dp equal slices' mean-loss gradients, in the ranks' order of operations (x 1/dp, then summed)."""
    total = {}
    for rows in torch.arange(len(ids)).chunk(dp):
        model.zero_grad(set_to_none=True)
        model(ids[rows], labels[rows]).mean().backward()
        for n, p in model.named_parameters():
            part = p.grad * (1.0 / dp)
            total[n] = part if n not in total else total[n] + part
    return total


def reference_training(model, steps, dp):
    """torch.optim.AdamW (foreach, no decay for biases and 1-D params) + clip_grad_norm_, each step on the
    global-batch gradient computed with the ranks' arithmetic; returns the grad norms."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in named if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, foreach=True)
    norms = []
    for step in range(steps):
        grads = global_batch_grads(model, *global_batch(step), dp=dp)
        for n, p in named:
            p.grad = grads[n]
        norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP, foreach=True).item())
        opt.step()
    return norms


def _tied_gpt_distributed_optimizer_worker(pe):
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.distributed.param_and_grad_buffer import shard_ranges

    rank, dp = dist.get_rank(), dist.get_world_size()
    model = tiny_model(position_embedding_type=pe)
    one_pass_grads = global_batch_grads(copy.deepcopy(model), *global_batch(0))  # the textbook gradient
    reference = copy.deepcopy(model)  # before wrapping: DDP moves param.data into its buffer
    ref_norms = reference_training(reference, STEPS, dp)

    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                 use_distributed_optimizer=True), [ddp])
    tied = model.word_embeddings.weight
    buckets = [b for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]
    occurrences = sum(p is tied for b in buckets for p in b.params_list)
    rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    norms, grad_errors = [], {}
    for step in range(STEPS):
        ids, labels = global_batch(step)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(ids[rows], labels[rows]).mean().backward()
        ddp.finish_grad_sync()
        if step == 0:  # this rank's reduce-scattered shard vs the one-pass global-batch gradient
            for s in shard_ranges([ddp]):
                name = ddp.param_to_name[s.model_param]
                expected = one_pass_grads[name].reshape(-1)[s.param_start:s.param_end]
                actual = s.buffer.grad_data[s.buffer_start:s.buffer_end]
                scale = one_pass_grads[name].abs().max().item()
                grad_errors[name] = ((actual - expected).abs().max() / scale).item()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    ddp.finish_param_sync()
    param_errors, key_bias_errors = {}, []
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = (p.detach() - q.detach()).abs() / q.detach().abs().max()
        if name.endswith("linear_qkv.bias"):  # [q | k | v]: set the ill-conditioned key slice apart
            key = slice(HIDDEN, 2 * HIDDEN)
            key_bias_errors.append(err[key].max().item())
            err[key] = 0.0
        param_errors[name] = err.max().item()
    return dict(occurrences=occurrences, grad_errors=grad_errors, norms=norms, ref_norms=ref_norms,
                param_errors=param_errors, key_bias_errors=key_bias_errors, num_buckets=len(buckets),
                params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("pe", POSITION_TYPES)
def test_tied_gpt_with_distributed_optimizer_matches_global_batch_adamw(pe):
    """Would catch tied embeddings mishandled by DDP or the distributed optimizer: the weight bucketed or
    sharded twice, its post-accumulate hook firing per use (second-gradient error / half a gradient
    communicated), one of its two gradient contributions lost or counted twice (wrong grad and grad norm),
    or ranks ending with different weights.

    Tolerances (1e-5 relative, not bit-exact): the step-0 gradient shards are compared with the one-pass
    global-batch gradient (other matmul and mean reduction order than two half batches averaged by the
    reduce-scatter); the distributed optimizer sums the grad norm's squares per shard, so from step 1 on
    the clip coefficient, hence the parameters, differ in the last bits. The parameters after 3 steps are
    compared with AdamW on the global-batch gradient taken in the ranks' order of operations (mean of the
    two half-batch gradients; vs the one-pass gradient, Adam's element-wise normalization turns rounding
    in near-zero gradient elements into differences up to ~1.5e-5). The key slice of linear_qkv.bias is
    held to 1e-3 only: its true gradient is (learned) exactly zero, softmax being shift-invariant, or
    (rope) nearly so, so Adam scales last-bit differences of pure rounding noise into lr-sized steps.
    """
    results = run_distributed(_tied_gpt_distributed_optimizer_worker, 2, pe)
    for r in results:
        assert r["occurrences"] == 1  # the tied weight lives in exactly one bucket, once
        assert r["num_buckets"] > 1  # overlap really had several buckets to launch
        assert all(n > CLIP for n in r["ref_norms"]), "clipping must be active in this test"
        for a, b in zip(r["norms"], r["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r["norms"], r["ref_norms"])
        assert "word_embeddings.weight" in r["grad_errors"]  # each rank owns part of the tied weight
        assert max(r["grad_errors"].values()) <= 1e-5, r["grad_errors"]
        assert max(r["param_errors"].values()) <= 1e-5, r["param_errors"]
        assert max(r["key_bias_errors"]) <= 1e-3, r["key_bias_errors"]
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), name  # all-gathered: bitwise identical
