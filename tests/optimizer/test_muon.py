"""Muon (optimizer/muon.py, optimizer='muon'): the config's rules, Newton-Schulz bitwise torch.optim.Muon's,
the scale modes vs torch's adjust_lr_fn, which parameters Muon steps (also after a meta-device build and under
ZeRO-3, DeepSpeed's silent failure), the fused QKV's three matrices."""

import copy
import math

import pytest
import torch
from distributed_helper import run_distributed
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from megatron_lite.distributed.meta_init import meta_device_init
from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.optimizer import OptimizerConfig
from megatron_lite.optimizer.muon import (
    COEFFICIENT_SETS,
    MatrixSpec,
    matrix_specs,
    muon_scale_factor,
    newton_schulz,
    ns_coefficients,
    orthogonalize,
)

SIMPLE = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default ns_coefficients


def tiny_gpt(**overrides):
    config = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, vocab_size=40,
                  max_position_embeddings=8)
    config.update(overrides)
    return GPTModel(GPTConfig(**config))


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(optimizer="lion"), ValueError, "optimizer must be 'adam', 'sgd' or 'muon'"),
    (dict(muon_num_ns_steps=7), ValueError, "muon_num_ns_steps must be a multiple of 5 with muon_coefficient_type "
                                            "'quintic'"),
    (dict(muon_coefficient_type="aol", muon_num_ns_steps=6), ValueError, "a multiple of 4"),
    (dict(muon_coefficient_type="polar_express"), ValueError, "muon_num_ns_steps must be >= 8"),
    (dict(muon_coefficient_type="simple", muon_num_ns_steps=0), ValueError, "muon_num_ns_steps must be in [1, 100)"),
    (dict(muon_num_ns_steps=5.0), TypeError, "muon_num_ns_steps must be an int"),
    (dict(muon_coefficient_type="cubic"), ValueError, "muon_coefficient_type must be one of"),
    (dict(muon_scale_mode="rms"), ValueError, "muon_scale_mode must be one of"),
    (dict(muon_scalar_optimizer="lion"), ValueError, "muon_scalar_optimizer must be 'adam'"),
    (dict(muon_momentum=1.0), ValueError, "muon_momentum must be in [0, 1)"),
    (dict(muon_momentum=-0.1), ValueError, "muon_momentum must be in [0, 1)"),
    (dict(muon_nesterov=1), TypeError, "muon_nesterov must be a bool"),
    (dict(muon_split_qkv="no"), TypeError, "muon_split_qkv must be a bool"),
    (dict(muon_extra_scale_factor=0.0), ValueError, "muon_extra_scale_factor must be a number > 0"),
    (dict(optimizer="muon", optimizer_cpu_offload=True), ValueError, "optimizer='muon' does not support "
                                                                     "optimizer_cpu_offload"),
    (dict(optimizer="muon", optimizer_class=torch.optim.NAdam), ValueError, "optimizer='muon' and optimizer_class"),
    (dict(optimizer="muon", muon_tp_mode="duplicated"), TypeError, "muon_tp_mode"),
    (dict(optimizer="muon", muon_fp32_matmul_prec="medium"), TypeError, "muon_fp32_matmul_prec"),
    (dict(optimizer="muon", muon_use_syrk=True), TypeError, "muon_use_syrk"),
])
def test_config_refuses_with_the_field_named(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        OptimizerConfig(**kwargs)


def test_config_defaults_are_megatron_cores():
    c = OptimizerConfig(optimizer="muon")
    assert (c.muon_momentum, c.muon_nesterov, c.muon_split_qkv, c.muon_scale_mode, c.muon_coefficient_type,
            c.muon_num_ns_steps, c.muon_extra_scale_factor, c.muon_scalar_optimizer) == (
        0.95, False, True, "spectral", "quintic", 5, 1.0, "adam")
    OptimizerConfig(optimizer="muon", muon_coefficient_type="polar_express", muon_num_ns_steps=9)
    OptimizerConfig(optimizer="muon", muon_coefficient_type="simple", muon_num_ns_steps=3)


# ---------------------------------------------------------------------------------------------- math


def test_coefficients_per_iteration():
    """quintic and aol repeat their lists, polar_express repeats its last set, simple its only one."""
    assert ns_coefficients("simple", 3) == (SIMPLE,) * 3
    q = COEFFICIENT_SETS["quintic"]
    assert ns_coefficients("quintic", 10) == q + q
    p = COEFFICIENT_SETS["polar_express"]
    assert ns_coefficients("polar_express", 10) == p + (p[-1], p[-1])
    assert ns_coefficients("aol", 8) == COEFFICIENT_SETS["aol"] * 2
    with pytest.raises(ValueError, match="multiple of 5"):
        ns_coefficients("quintic", 4)


@pytest.mark.parametrize("shape", [(8, 16), (16, 8), (12, 12), (40, 6), (3, 29), (1, 5)])
@pytest.mark.parametrize("steps", [1, 5])
def test_simple_newton_schulz_is_torch_muons_bitwise(shape, steps):
    """Would catch any change of op order, dtype or orientation against torch.optim.Muon (tall and wide)."""
    gen = torch.Generator().manual_seed(sum(shape) + steps)
    for x in (torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen).bfloat16()):
        keep = x.clone()
        ours = newton_schulz(x, steps, "simple")
        theirs = _zeropower_via_newtonschulz(x.clone(), SIMPLE, steps, 1e-7)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
        assert torch.equal(x, keep)  # a bf16 input is not normalized in place (torch's is)


@pytest.mark.parametrize("kind, steps", [("quintic", 5), ("polar_express", 8), ("aol", 4)])
def test_every_coefficient_set_orthogonalizes(kind, steps):
    """Would catch a wrong coefficient or sign: the singular values come out near 1 (bf16, loosely)."""
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    s = torch.linalg.svdvals(newton_schulz(x, steps, kind).float())
    assert s.min() > 0.3 and s.max() < 1.5, (kind, s)


@pytest.mark.parametrize("rows, cols", [(8, 16), (16, 8), (12, 12), (48, 16)])
def test_scale_modes_match_torch_adjust_lr(rows, cols):
    """shape_scaling is torch's 'original', spectral x 0.2 its 'match_rms_adamw', bitwise once times lr."""
    lr = 0.0123
    assert lr * muon_scale_factor(rows, cols, "shape_scaling") == _adjust_lr(lr, "original", (rows, cols))
    assert lr * (muon_scale_factor(rows, cols, "spectral") * 0.2) == _adjust_lr(lr, "match_rms_adamw", (rows, cols))
    assert muon_scale_factor(rows, cols, "unit_rms_norm") == math.sqrt(rows / cols)


def test_orthogonalize_takes_each_qkv_block_as_its_own_matrix():
    """Would catch a split QKV orthogonalized as one fused matrix."""
    spec = MatrixSpec(32, 16, (16, 8, 8))
    config = OptimizerConfig(optimizer="muon")
    u = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    blocks = [newton_schulz(b, 5, "quintic").reshape(-1) for b in u.split([16, 8, 8])]
    assert torch.equal(orthogonalize(u.reshape(-1), spec, config), torch.cat(blocks))
    assert not torch.equal(orthogonalize(u, MatrixSpec(32, 16, (32,)), config), torch.cat(blocks))
    assert spec.blocks == ((0, 256, 16), (256, 384, 8), (384, 512, 8))


# ---------------------------------------------------------------------------------------------- classification


def _count(specs):
    return sum(s is not None for s in specs.values()), sum(s is None for s in specs.values())


def test_which_parameters_muon_steps_in_the_gpt():
    """Would catch an embedding, output layer, norm or bias on Muon, or a weight matrix silently on AdamW."""
    model = tiny_gpt(share_embeddings_and_output_weights=False)
    specs = matrix_specs([model], OptimizerConfig(optimizer="muon"))
    muon = sorted(n for n, p in model.named_parameters() if specs[p] is not None)
    per_layer = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_proj.weight",
                 "self_attention.linear_qkv.weight"]
    assert muon == sorted(["position_embeddings.weight"] + [f"layers.{i}.{n}" for i in range(2) for n in per_layer])
    assert specs[model.layers[0].self_attention.linear_qkv.weight] == MatrixSpec(32, 16, (16, 8, 8))
    assert specs[model.layers[0].mlp.linear_fc1.weight] == MatrixSpec(64, 16, (64,))
    unsplit = matrix_specs([model], OptimizerConfig(optimizer="muon", muon_split_qkv=False))
    assert unsplit[model.layers[1].self_attention.linear_qkv.weight] == MatrixSpec(32, 16, (32,))
    model.layers[0].mlp.linear_fc2.weight.use_muon = False
    assert _count(matrix_specs([model], OptimizerConfig(optimizer="muon"))) == (8, len(specs) - 8)


def test_tags_survive_deepcopy_and_the_tied_embedding_stays_on_adamw():
    """Would catch copy.deepcopy(model) (torch rebuilds Parameters without their attributes) sending the
    embeddings to Muon and losing the QKV split."""
    model = copy.deepcopy(tiny_gpt())
    specs = matrix_specs([model], OptimizerConfig(optimizer="muon"))
    assert specs[model.word_embeddings.weight] is None
    assert specs[model.layers[1].self_attention.linear_qkv.weight].row_splits == (16, 8, 8)


def test_a_fused_qkv_without_its_splits_is_refused():
    """Would catch the split silently skipped (Megatron skips it with a debug log)."""
    model = tiny_gpt()
    del model.layers[1].self_attention.linear_qkv.weight.matrix_row_splits
    with pytest.raises(ValueError, match=r"layers\.1\.self_attention\.linear_qkv\.weight.*muon_split_qkv=False"):
        matrix_specs([model], OptimizerConfig(optimizer="muon"))
    assert matrix_specs([model], OptimizerConfig(optimizer="muon", muon_split_qkv=False))
    model.layers[1].self_attention.linear_qkv.weight.matrix_row_splits = (16, 8, 4)
    with pytest.raises(ValueError, match="adding up to its 32 rows"):
        matrix_specs([model], OptimizerConfig(optimizer="muon"))


def test_expert_parameters_are_refused():
    model = tiny_gpt()
    model.layers[0].mlp.linear_fc1.weight.allreduce = False
    with pytest.raises(ValueError, match="expert-parallel parameters"):
        matrix_specs([model], OptimizerConfig(optimizer="muon"))


@pytest.mark.parametrize("how", ["recorded", "plain"])
def test_meta_built_gpt_keeps_its_tags(how):
    """The tags are set on the meta Parameters (before any storage)."""
    if how == "recorded":
        with meta_device_init():
            model = tiny_gpt()
    else:
        with torch.device("meta"):
            model = tiny_gpt()
    expected = matrix_specs([tiny_gpt()], OptimizerConfig(optimizer="muon"))
    specs = matrix_specs([model], OptimizerConfig(optimizer="muon"))
    assert list(specs.values()) == list(expected.values())


def _wrapped_specs_worker(strategy, meta):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    if meta:
        with meta_device_init():
            model = tiny_gpt()
    else:
        model = tiny_gpt()
    sharded = strategy != "no_shard"
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, use_distributed_optimizer=sharded, bucket_size=500,
        overlap_grad_reduce=True, fsdp_unit_modules=("TransformerLayer",)))
    specs = matrix_specs([ddp], OptimizerConfig(optimizer="muon", use_distributed_optimizer=sharded))
    released = sum(s is not None and 0 in p.data.stride() for p, s in specs.items())  # no storage of its own
    return _count(specs), [(ddp.param_to_name[p], s) for p, s in specs.items()], released


@pytest.mark.parametrize("strategy, meta", [("no_shard", False), ("optim_grads_params", False),
                                            ("optim_grads_params", True)])
def test_zero3_and_meta_builds_still_put_the_matrices_on_muon(strategy, meta):
    """DeepSpeed's silent failure (PR 8438): under ZeRO-3 a parameter's local tensor is a placeholder, so a rule
    on its local shape sends every matrix to AdamW. Counted: 9 matrices (two layers' four and the position
    embedding) on Muon, at every strategy, built normally or on the meta device."""
    results = run_distributed(_wrapped_specs_worker, 2, strategy, meta, timeout=120)
    reference = _count(matrix_specs([tiny_gpt()], OptimizerConfig(optimizer="muon")))
    for counts, named, _ in results:
        assert counts == reference and counts[0] == 9
        assert named == results[0][1]
    if strategy == "optim_grads_params":  # the matrices really are released placeholders there
        assert results[0][2] == 9
