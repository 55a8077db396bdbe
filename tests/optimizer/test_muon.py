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


@pytest.mark.parametrize("splits", [32, (8.5, 23.5), (16.0, 8, 8), ("16", 8, 8), (True, 15, 16),
                                    torch.tensor([16, 8, 8])])
def test_matrix_row_splits_that_are_not_row_counts_are_refused(splits):
    """matrix_row_splits must be a tuple (or list) of ints: a TypeError naming the parameter and the attribute.
    Failed before: an int raised Python's "'int' object is not iterable", a string "invalid literal for int()"
    (neither naming anything), 8.5 + 23.5 was truncated to 8 + 23 and reported as such, and a bool or a tensor
    was taken as row counts."""
    model = tiny_gpt()
    model.layers[1].self_attention.linear_qkv.weight.matrix_row_splits = splits
    with pytest.raises(TypeError, match=r"layers\.1\.self_attention\.linear_qkv\.weight: matrix_row_splits must be "
                                        r"a tuple of ints"):
        matrix_specs([model], OptimizerConfig(optimizer="muon"))
    model.layers[1].self_attention.linear_qkv.weight.matrix_row_splits = [16, 8, 8]  # a list is fine
    assert matrix_specs([model], OptimizerConfig(optimizer="muon"))[
        model.layers[1].self_attention.linear_qkv.weight].row_splits == (16, 8, 8)


def test_expert_parameters_are_refused():
    model = tiny_gpt()
    model.layers[0].mlp.linear_fc1.weight.allreduce = False
    with pytest.raises(ValueError, match="expert-parallel parameters"):
        matrix_specs([model], OptimizerConfig(optimizer="muon"))


def test_a_model_with_no_matrix_for_muon_is_refused():
    """DeepSpeed's zero.Init scenario: every parameter looks flat (1-D), so Muon would step nothing and AdamW
    everything, silently. Refused on construction, naming the flag."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        flat = torch.nn.ParameterList(torch.nn.Parameter(p.detach().reshape(-1).clone()) for p in model.parameters())
    with pytest.raises(ValueError, match=r"--optimizer muon\) found no parameter to step with Muon"):
        matrix_specs([flat], OptimizerConfig(optimizer="muon"))
    assert _count(matrix_specs([model], OptimizerConfig(optimizer="muon"))) == (2, 2)


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


# ---------------------------------------------------------------------------------------------- the optimizer
LR, WD, CLIP = 2e-2, 0.1, 0.5
SCALES = {"original": dict(muon_scale_mode="shape_scaling", muon_extra_scale_factor=1.0),
          "match_rms_adamw": dict(muon_scale_mode="spectral", muon_extra_scale_factor=0.2)}


def _gpt_batches(step, dp=2, micro_batches=2):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 40, (dp, micro_batches, 2, 8), generator=gen)
    return tokens, torch.roll(tokens, -1, -1)


def _reference_grads(master, step, dtype):
    """The data-parallel mean gradient with the ranks' arithmetic (ddp_testing.reference_grads, for the GPT):
    each rank's micro-batch gradients summed (in a `dtype` copy), then pre-scaled by 1/2 and added."""
    tokens, labels = _gpt_batches(step)
    per_rank = []
    for r in range(2):
        copy_ = copy.deepcopy(master).to(dtype)
        acc = {n: torch.zeros_like(p) for n, p in copy_.named_parameters()}
        for m in range(tokens.shape[1]):
            copy_.zero_grad(set_to_none=True)
            (copy_(tokens[r, m], labels=labels[r, m]).mean() / tokens.shape[1]).backward()
            for n, p in copy_.named_parameters():
                acc[n].add_(p.grad)
        per_rank.append(acc)
    return {n: (per_rank[0][n] * 0.5 + per_rank[1][n] * 0.5).float() for n in per_rank[0]}


class TorchMuonAdamW:
    """The reference: torch.optim.Muon on the matrices (a fused QKV held as three parameters, Q, K and V,
    sliced from it) and torch.optim.AdamW (foreach) on the rest, with torch's clip_grad_norm_ on the model's
    own gradients first."""

    def __init__(self, model, nesterov, adjust_lr_fn, momentum=0.95, clip=CLIP):
        self.model, self.clip, self.splits = model, clip, {}
        matrices, decay, no_decay = [], [], []
        for name, p in model.named_parameters():
            if len(p.shape) == 2 and not getattr(p, "is_embedding_or_output_parameter", False):
                if name.endswith("linear_qkv.weight"):
                    parts = [torch.nn.Parameter(b.detach().clone()) for b in p.split(list(p.matrix_row_splits))]
                    self.splits[p] = parts
                    matrices += parts
                else:
                    matrices.append(p)
            else:
                (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
        self.muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=momentum, nesterov=nesterov,
                                     ns_coefficients=SIMPLE, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
        groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW(groups, lr=LR, foreach=True)
        self.num_matrices = len(matrices)

    @torch.no_grad()
    def step(self, grads=None):
        """`grads`: by name (else the model's .grad as they are)."""
        if grads is not None:
            for n, p in self.model.named_parameters():
                p.grad = grads[n].clone()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), self.clip, foreach=True)
        for fused, parts in self.splits.items():
            if fused.grad is None:
                continue
            for part, g in zip(parts, fused.grad.split([q.shape[0] for q in parts])):
                part.grad = g.clone()
        self.muon.step()
        self.adam.step()
        for fused, parts in self.splits.items():
            fused.copy_(torch.cat([q.detach() for q in parts]))

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        for parts in self.splits.values():
            for q in parts:
                q.grad = None


def _muon_config(**overrides):
    config = dict(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, muon_coefficient_type="simple",
                  muon_num_ns_steps=5)
    config.update(overrides)
    return OptimizerConfig(**config)


def _build(dtype=torch.float32, **config):
    """The tiny GPT (untied), wrapped at no_shard, and its optimizer."""
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    torch.manual_seed(0)
    model = tiny_gpt(share_embeddings_and_output_weights=False).to(dtype)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=700))
    return model, ddp, get_megatron_optimizer(_muon_config(bf16=dtype == torch.bfloat16, **config), ddp)


def _train_step(ddp, opt, rank, step):
    tokens, labels = _gpt_batches(step)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    for m in range(tokens.shape[1]):
        loss = ddp(tokens[rank, m], labels=labels[rank, m]).mean() / tokens.shape[1]
        if m < tokens.shape[1] - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    ddp.finish_grad_sync()
    return opt.step()


def _gpt_worker(nesterov, adjust_lr_fn, dtype, steps):
    import torch.distributed as dist

    rank = dist.get_rank()
    model, ddp, opt = _build(dtype, muon_nesterov=nesterov, **SCALES[adjust_lr_fn])
    torch.manual_seed(0)
    master = tiny_gpt(share_embeddings_and_output_weights=False)
    with torch.no_grad():  # the reference starts from the (rounded) low-precision weights
        for p, q in zip(master.parameters(), model.parameters()):
            p.copy_(q.float())
    reference = TorchMuonAdamW(master, nesterov, adjust_lr_fn)
    counts = (sum(len(g["params"]) for g in opt.param_groups if g["use_muon"]), reference.num_matrices)
    diffs, sgd_like = [], None
    for step in range(steps):
        fc1 = model.layers[0].mlp.linear_fc1.weight
        before = fc1.detach().float().clone()
        _train_step(ddp, opt, rank, step)
        reference.step(_reference_grads(master, step, dtype))
        if step == 0 and adjust_lr_fn == "original":  # no_shard really orthogonalizes (DeepSpeed's stage-0 Muon
            # was plain SGD): the update over lr x scale has singular values near 1, not the gradient's direction
            update = (before * (1 - LR * WD) - fc1.detach().float()) / (LR * muon_scale_factor(64, 16, "shape_scaling"))
            s = torch.linalg.svdvals(update)
            cosine = torch.nn.functional.cosine_similarity(update.reshape(-1), fc1.main_grad.float().reshape(-1), dim=0)
            sgd_like = (s.min().item(), s.max().item(), cosine.item())
        # the fp32 main params (the model's own with fp32; its bf16 copy is their rounding)
        diffs.append(max((opt.main_of[p] - q).abs().max().item() for p, q in zip(model.parameters(),
                                                                                  master.parameters())))
    state = opt.state_dict()["state"]
    keys = {n: sorted(k for k in e if k not in ("param", "step")) for n, e in state.items()}
    return counts, diffs, sgd_like, keys


@pytest.mark.parametrize("nesterov, adjust_lr_fn", [(False, "original"), (True, "match_rms_adamw")])
def test_no_shard_is_torch_muon_and_adamw_bitwise(nesterov, adjust_lr_fn):
    """dp=2, no_shard, fp32, clipping on, 4 steps: every parameter bitwise what torch.optim.Muon (Q, K, V as three
    parameters) + torch.optim.AdamW give on one process. Would catch a matrix left to AdamW (or an embedding on
    Muon), the QKV split skipped, the update scaled or decayed otherwise, clipping after the momentum, or an
    SGD-like update (no Newton-Schulz, DeepSpeed issue 8441)."""
    for counts, diffs, sgd_like, keys in run_distributed(_gpt_worker, 2, nesterov, adjust_lr_fn, torch.float32, 4,
                                                         timeout=180):
        assert counts == (9, 13)  # 9 matrices; the reference's 13 are them with the two QKVs as three each
        assert diffs == [0.0] * 4, diffs
        if sgd_like is not None:
            assert 0.3 < sgd_like[0] and sgd_like[1] < 1.5 and sgd_like[2] < 0.9, sgd_like
        # the torch-format state: a Muon matrix carries torch.optim.Muon's one key, the rest AdamW's
        assert keys["layers.0.self_attention.linear_qkv.weight"] == ["momentum_buffer"]
        assert keys["position_embeddings.weight"] == ["momentum_buffer"]
        assert keys["word_embeddings.weight"] == keys["layers.1.mlp.linear_fc2.bias"] == ["exp_avg", "exp_avg_sq"]


def test_bf16_main_params_are_the_reference_on_bf16_gradients_bitwise():
    """bf16 parameters, fp32 main params: after 3 steps the main params are bitwise the fp32 reference's when its
    gradients come from a bf16 copy of its weights with the ranks' arithmetic (the bound: 0; the bf16 model is
    their rounding, within 4e-3 of them here). Would catch the momentum or Newton-Schulz run on the bf16
    model copy, or the update written in bf16."""
    for counts, diffs, _, _ in run_distributed(_gpt_worker, 2, False, "original", torch.bfloat16, 3, timeout=180):
        assert counts == (9, 13)
        assert diffs == [0.0] * 3, diffs


# ---------------------------------------------------------------------------------------------- resume
def _resume_worker(root):
    import os

    import torch.distributed as dist
    from optim_testing import full_state, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, failures = dist.get_rank(), []
    for fmt in ("torch", "torch_dist"):
        for dtype in (torch.float32, torch.bfloat16):
            where = os.path.join(root, f"{fmt}_{dtype}")
            model, ddp, opt = _build(dtype, muon_nesterov=True)
            sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
            for step in range(2):
                _train_step(ddp, opt, rank, step)
            checkpointing.save_checkpoint(where, 2, ddp, opt, sched, 16, ckpt_format=fmt)
            for step in range(2, 4):
                _train_step(ddp, opt, rank, step)
            straight = full_state(opt)
            model, ddp, opt = _build(dtype, muon_nesterov=True)
            sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
            checkpointing.load_checkpoint(where, ddp, opt, sched)
            for step in range(2, 4):
                _train_step(ddp, opt, rank, step)
            resumed = full_state(opt)
            if not states_equal(straight, resumed):
                failures.append((fmt, str(dtype)))
            qkv = opt.main_of[model.layers[0].self_attention.linear_qkv.weight]
            adam = opt.main_of[model.layers[0].self_attention.linear_qkv.bias]
            keys = sorted(opt.optimizer.state[qkv]), sorted(opt.optimizer.state[adam])
            if keys != (["momentum_buffer"], ["exp_avg", "exp_avg_sq", "step"]):
                failures.append((fmt, str(dtype), "state keys", keys))
    return failures


def test_resume_is_bit_exact_in_both_formats(tmp_path):
    """fp32 and bf16 at no_shard, saved after 2 steps ('torch' and 'torch_dist') and resumed for 2: every main
    param, momentum buffer and AdamW moment equal to the run that went straight on, and a Muon matrix's state
    only torch.optim.Muon's 'momentum_buffer' (no zero exp_avg made for it, no buffer for an AdamW parameter).
    Would catch a momentum buffer left out of a format or restored under another key."""
    for failures in run_distributed(_resume_worker, 2, str(tmp_path), timeout=300):
        assert not failures, failures


def _heads_worker(heads, resume):
    import torch.distributed as dist
    from optim_testing import TwoHeads, heads_side_by_side
    from torch import nn

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    torch.manual_seed(0)
    model = TwoHeads()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(find_unused_parameters=True, bucket_size=30))
    torch_opt = TorchMuonAdamW(reference, nesterov=False, adjust_lr_fn="original", clip=0.0)

    def built():
        return get_megatron_optimizer(_muon_config(clip_grad=0.0, **SCALES["original"]), ddp)

    return heads_side_by_side(ddp, built, reference, torch_opt, heads, resume, dist.get_rank())[0]


@pytest.mark.parametrize("heads", ["lagging", "never_stepped"])
@pytest.mark.parametrize("resume", ["torch", "shards"])
def test_a_head_that_skipped_steps_resumes_like_torch(heads, resume):
    """A head no rank used for some steps (its AdamW bias lags, its Muon matrix keeps its buffer) or for every
    step before the round trip (no state at all: torch.optim.Muon starts its buffer from zeros at its first
    gradient): bitwise torch.optim.Muon + AdamW on torch DDP after each step. Would catch a zero buffer or
    moments saved for a parameter that never stepped and restored as state, or a Muon matrix given a step."""
    for diffs in run_distributed(_heads_worker, 2, heads, resume):
        assert diffs == [0.0] * 5, diffs


# ---------------------------------------------------------------------------------------------- refusals
def _one_rank_optimizer(**config):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    sharded = config.get("use_distributed_optimizer", False)
    ddp = DistributedDataParallel(tiny_gpt(), DistributedDataParallelConfig(use_distributed_optimizer=sharded))
    return get_megatron_optimizer(_muon_config(**config), ddp)


def test_resume_checks_the_muon_hyperparameters(single_rank_group):
    """Would catch a checkpoint of another momentum (or Newton-Schulz setting) resumed silently."""
    state = _one_rank_optimizer().state_dict()
    assert [g["use_muon"] for g in state["param_groups"]] == [True, False, False]
    assert state["param_groups"][0]["muon_momentum"] == 0.95 and "muon_momentum" not in state["param_groups"][1]
    with pytest.raises(ValueError, match="optimizer muon_momentum .* is 0.9 in this run but 0.95"):
        _one_rank_optimizer(muon_momentum=0.9).load_state_dict(state)
    with pytest.raises(ValueError, match="written by optimizer 'muon', this is 'adam'"):
        from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(tiny_gpt(), DistributedDataParallelConfig())
        get_megatron_optimizer(OptimizerConfig(lr=LR), ddp).load_state_dict(state)


def test_muon_values_taken_from_the_checkpoint_are_the_ones_stepped(single_rank_group):
    """hyperparameters='checkpoint' takes the checkpoint's muon_* values: the step after the resume is then
    bitwise a run built with them (Newton-Schulz's coefficient type and steps included, which the
    orthogonalization reads from the optimizer's config, not from the param group), and the next checkpoint
    records them. muon_split_qkv decides the matrices when the optimizer is built: taking another one from the
    checkpoint is refused, naming it. Failed before: the group said the checkpoint's 'simple' x 5 while
    Newton-Schulz ran this run's 'quintic' x 10."""
    def stepped(model_ddp_opt, state, hyperparameters):
        model, ddp, opt = model_ddp_opt
        opt.load_state_dict(state, hyperparameters)
        _train_step(ddp, opt, 0, 2)
        return [opt.main_of[p].clone() for p in model.parameters()], opt.state_dict()["param_groups"]

    model, ddp, opt = _build(muon_momentum=0.9)
    _train_step(ddp, opt, 0, 0)
    state = opt.state_dict()
    same, _ = stepped(_build(muon_momentum=0.9), state, "check")
    taken, groups = stepped(_build(muon_coefficient_type="quintic", muon_num_ns_steps=10, muon_nesterov=True,
                                   **SCALES["match_rms_adamw"]), state, "checkpoint")
    assert all(torch.equal(a, b) for a, b in zip(same, taken))
    assert (groups[0]["muon_coefficient_type"], groups[0]["muon_num_ns_steps"], groups[0]["muon_momentum"]) == \
        ("simple", 5, 0.9)
    kept, _ = stepped(_build(muon_coefficient_type="quintic", muon_num_ns_steps=10), state, "override")
    assert not all(torch.equal(a, b) for a, b in zip(same, kept))  # this run's values: another update
    with pytest.raises(ValueError, match="muon_split_qkv is False in this run but True in the checkpoint.*"
                                         "build with muon_split_qkv=True"):
        _build(muon_split_qkv=False)[2].load_state_dict(state, "checkpoint")


def test_the_adamw_part_keeps_its_moments_of_squares_checked():
    """A replica's state is refused when a moment of squares is negative (recv_shard_state reads
    OptimizerKind.nonnegative_keys): optimizer='muon' names its AdamW part's exp_avg_sq (Muon's momentum buffer
    is signed). Failed before: () for the mixed kind, whose class is not torch.optim's, so a damaged exp_avg_sq of
    an embedding came back (its square root: NaN parameters)."""
    from megatron_lite.optimizer import optimizer_kind

    kind = optimizer_kind(_muon_config())
    assert kind.nonnegative_keys == ("exp_avg_sq",)
    assert kind.of_group({"use_muon": True}).nonnegative_keys == ()


def _marked_gpt(position_on_adamw):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    torch.manual_seed(0)
    model = tiny_gpt(share_embeddings_and_output_weights=False)
    if position_on_adamw:
        model.position_embeddings.weight.use_muon = False
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=700))
    return model, ddp, get_megatron_optimizer(_muon_config(), ddp)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("saved_on_adamw", [False, True])
def test_a_parameter_moved_between_muon_and_adamw_is_refused_on_resume(single_rank_group, tmp_path, fmt,
                                                                       saved_on_adamw):
    """A checkpoint that keeps a parameter's state as the other part's (position_embeddings.weight on Muon when
    saved, use_muon=False now, or the reverse) is refused, naming it and what to do; without the optimizer
    state it loads. Failed before: both formats dropped the foreign keys and the parameter silently started a
    fresh state (AdamW from step 1 with zero moments, or Muon from a zero buffer)."""
    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = _marked_gpt(saved_on_adamw)
    for step in range(2):
        _train_step(ddp, opt, 0, step)
    checkpointing.save_checkpoint(str(tmp_path), 2, ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant"),
                                  4, ckpt_format=fmt)
    model, ddp, opt = _marked_gpt(not saved_on_adamw)
    sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
    words = (f"keeps position_embeddings.weight's optimizer state as {'AdamW' if saved_on_adamw else 'Muon'}'s .*"
             f"steps it with {'Muon' if saved_on_adamw else 'AdamW'}.*--no-load-optim")
    with pytest.raises(ValueError, match=words):
        checkpointing.load_checkpoint(str(tmp_path), ddp, opt, sched)
    checkpointing.load_checkpoint(str(tmp_path), ddp, opt, sched, load_optim=False)
    # the same classification resumes as before
    model, ddp, opt = _marked_gpt(saved_on_adamw)
    checkpointing.load_checkpoint(str(tmp_path), ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant"))
    assert opt.optimizer.state[opt.main_of[model.position_embeddings.weight]]


def test_last_words_of_a_parameter_moved_between_muon_and_adamw_are_refused(single_rank_group, tmp_path):
    """The last-words load refuses it too (inside its collective check, before any tensor is written), and
    loads with the same marks."""
    from megatron_lite.checkpointing import last_words
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = _marked_gpt(False)
    sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
    words = last_words.LastWords(str(tmp_path), opt, sched, 0, 0)
    for step in range(2):
        words.stage(step + 1, (step + 1) * 4)
        _train_step(ddp, opt, 0, step)
        sched.step()
        words.commit()
    assert words.write("test")
    sets, _ = last_words.scan(str(tmp_path))
    model, ddp, opt = _marked_gpt(True)
    with pytest.raises(ValueError, match="keeps position_embeddings.weight's optimizer state as Muon's"):
        last_words.load(sets[2], ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant"))
    model, ddp, opt = _marked_gpt(False)
    assert last_words.load(sets[2], ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant"))


def test_adamw_steps_are_restored_where_its_fused_kernel_keeps_them():
    """Where the inner optimizer's AdamW part runs torch's fused kernel (CUDA), a restored 'step' goes on the
    parameter's device, as torch.optim's load_state_dict puts it for fused / capturable groups (the kernel reads
    it there). Seen on the meta device here (the CPU cannot tell the two places apart). Failed before: the
    place was decided from MuonWithAdamW's own defaults, which have no 'fused': the step went to the CPU."""
    from megatron_lite.optimizer import optimizer_kind
    from megatron_lite.optimizer.muon import MuonWithAdamW
    from megatron_lite.optimizer.optimizer_state import MainShard, ShardState

    config = _muon_config()
    w, b = (torch.nn.Parameter(torch.zeros(shape, device="meta")) for shape in ((4, 4), (4,)))
    inner = MuonWithAdamW([{"params": [w], "use_muon": True, "weight_decay": WD},
                           {"params": [b], "weight_decay": 0.0}], lr=LR, weight_decay=WD, config=config, fused=True)
    state = ShardState(inner, optimizer_kind(config), [MainShard(w, 0, 16, w), MainShard(b, 0, 4, b)],
                       {w: "w", b: "b"}, None)
    state._set_state_of(b, 3, {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}, {})
    assert inner.state[b]["step"].device.type == "meta"
    assert "step" not in inner.state.get(w, {})


def test_the_distributed_optimizers_state_dict_carries_each_parameters_own_keys(single_rank_group):
    """The 'torch' format of the distributed optimizer (DistributedOptimizer._gathered) writes for a Muon matrix
    only 'momentum_buffer' and for the rest only AdamW's moments, as the full-parameter optimizers do. Failed
    before: every key for every parameter (zeros where it has none), which a resume then took for a parameter
    moved between Muon and AdamW."""
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    torch.manual_seed(0)
    model = tiny_gpt(share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        bucket_size=700))
    opt = get_megatron_optimizer(_muon_config(use_distributed_optimizer=True), ddp)
    for step in range(2):
        _train_step(ddp, opt, 0, step)
    state = opt.state_dict()["state"]
    keys = {n: sorted(k for k in e if k not in ("param", "step")) for n, e in state.items()}
    assert keys["layers.0.self_attention.linear_qkv.weight"] == ["momentum_buffer"]
    assert keys["word_embeddings.weight"] == keys["layers.1.mlp.linear_fc2.bias"] == ["exp_avg", "exp_avg_sq"]
    model2 = tiny_gpt(share_embeddings_and_output_weights=False)
    ddp2 = DistributedDataParallel(model2, DistributedDataParallelConfig(bucket_size=700))
    get_megatron_optimizer(_muon_config(), ddp2).load_state_dict(opt.state_dict())  # to no_shard
