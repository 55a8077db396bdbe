"""Models nobody here wrote (third_party_models.py), trained by megatron_lite on 2 gloo ranks against
torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW on the same process group, compared after every step.

Every model x every sharding strategy: no_shard, optim, optim_grads, each without and with overlap_grad_reduce
(then with a small bucket_size, so buckets cut through the model), and optim_grads_params (ZeRO-3, which needs
the overlap). A step is MICRO_BATCHES micro-batches, all but the last under no_sync() on both sides. After each
step every parameter (frozen ones included, ZeRO-3's gathered with full_parameters()) and every buffer
(BatchNorm's running statistics and batch count, rotary tables) must equal torch's.

Tolerance: none -- bit-exact. In fp32 with dp=2 both sides run the same forward and backward on the same weights
and inputs; the data-parallel mean of two gradients is one commutative addition after an exact scaling by 1/2;
there is no clipping (clip_grad=0.0, torch's default); and both optimizers run torch's foreach AdamW,
elementwise (the distributed optimizer on shards of the same numbers), with the same param groups (megatron's
rule, mirrored in the reference: no weight decay for biases and 1-D parameters).

transformers / peft versions of the same traps run only where those packages are installed.
"""

import contextlib
import copy
from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

import pytest
import third_party_models as tpm
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed_helper import run_distributed

LR, WD, STEPS, MICRO_BATCHES = 1e-2, 0.1, 3, 2
SMALL_BUCKET = 64  # elements: several buckets per model, some parameters split across bucket boundaries
VOCAB, SEQ = 32, 8

# name -> (data_parallel_sharding_strategy, overlap_grad_reduce)
CONFIGS = {
    "no_shard": ("no_shard", False),
    "no_shard-overlap": ("no_shard", True),
    "optim": ("optim", False),
    "optim-overlap": ("optim", True),
    "optim_grads": ("optim_grads", False),
    "optim_grads-overlap": ("optim_grads", True),
    "optim_grads_params": ("optim_grads_params", True),
}


# ------------------------------------------------------------------------------ data and losses
def lm_batch(gen, rank, step):
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
    return (tokens[:, :-1],), tokens[:, 1:]


def lm_loss(logits, targets):
    logits = getattr(logits, "logits", logits)  # a transformers ModelOutput
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def image_batch(gen, rank, step):
    # Rank-dependent scale and shift: BatchNorm statistics differ per rank unless the buffers are broadcast.
    x = torch.randn(4, 3, 6, 6, generator=gen) * (1 + rank) + rank
    return (x,), torch.randint(0, 3, (4,), generator=gen)


def regression_batch(gen, rank, step):
    return (torch.randn(4, 6, generator=gen),), torch.randn(4, 2, generator=gen)


def task_batch(gen, rank, step):
    """Rank r runs branch (r + step) % 2 for the whole step: each branch is used by exactly one rank."""
    (x,), y = regression_batch(gen, rank, step)
    return (x, (rank + step) % 2), y


def mse(out, target):
    return ((out - target) ** 2).mean()


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=True, use_cache=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def peft_lora():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["layers.0", "layers.1"], modules_to_save=["head"])
    return get_peft_model(tpm.PretrainedMLP(), config)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable  # (generator, rank, step) -> (forward args, target)
    loss: Callable  # (output, target) -> scalar
    units: Optional[Tuple[str, ...]] = None  # ZeRO-3's fsdp_unit_modules (None: children of nn.ModuleLists)
    find_unused: bool = False  # torch DDP needs it when ranks run different branches; so does megatron_lite
    requires: Optional[str] = None  # an optional package; the case is skipped without it


CASES = {
    "tied_lm": Case(tpm.TiedLM, lm_batch, lm_loss),
    # Would fail on known bug 2 (BatchNorm running statistics not broadcast from rank 0 as torch DDP does);
    # known bug 4: no nn.ModuleList, so ZeRO-3 gets its units by class name.
    "resnet_bn": Case(tpm.tiny_resnet, image_batch, F.cross_entropy, units=("BasicBlock",)),
    "lora_frozen_base": Case(tpm.lora_mlp, regression_batch, mse),
    # Would fail on known bug 1 (ZeRO-3 + find_unused_parameters with rank-dependent branches: wrong numbers
    # or a gloo abort) in optim_grads_params.
    "rank_branches": Case(tpm.MultiTaskNet, task_batch, mse, units=("TaskBranch",), find_unused=True),
    "llama_gqa_rope": Case(tpm.TinyLlama, lm_batch, lm_loss),
    # Known bug 4: no nn.ModuleList, so ZeRO-3 gets its units by class name (or the whole model, see below).
    "sequential_list": Case(tpm.StackedMLP, regression_batch, mse, units=("ResidualMLP",)),
    "hf_llama_tied": Case(hf_llama, lm_batch, lm_loss, requires="transformers"),
    "peft_lora": Case(peft_lora, regression_batch, mse, requires="peft"),
}


# ------------------------------------------------------------------------------ the two training loops
def torch_param_groups(module):
    """megatron_lite's groups for torch's AdamW: trainable parameters, no weight decay for biases and 1-D ones."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if n.endswith(".bias") or p.dim() == 1]
    decay = [p for n, p in named if not (n.endswith(".bias") or p.dim() == 1)]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def build_pair(case, strategy, overlap, rebuild_reference=False, **ddp_kwargs):
    """(megatron_lite wrapper, its optimizer, torch DDP reference, torch AdamW) on identical copies of the model
    (`rebuild_reference`: the reference built again from the same seed, not deep-copied, which would drop the
    hooks a model registers on its parameters)."""
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    torch.manual_seed(0)
    model = case.build()
    if rebuild_reference:
        torch.manual_seed(0)
    copied = case.build() if rebuild_reference else copy.deepcopy(model)
    reference = nn.parallel.DistributedDataParallel(copied, find_unused_parameters=case.find_unused)
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap,
        **{"bucket_size": SMALL_BUCKET if overlap else None, "find_unused_parameters": case.find_unused,
           "fsdp_unit_modules": case.units if strategy == "optim_grads_params" else None, **ddp_kwargs})
    ddp = DistributedDataParallel(model, config)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0,
                                                 use_distributed_optimizer=strategy != "no_shard"), ddp)
    torch_opt = torch.optim.AdamW(torch_param_groups(reference.module), lr=LR, foreach=True)
    return ddp, opt, reference, torch_opt


def megatron_step(ddp, opt, loss_fn, micro_batches):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    for i, (args, target) in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(ddp(*args), target) / len(micro_batches)).backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok


def torch_step(reference, torch_opt, loss_fn, micro_batches):
    torch_opt.zero_grad()
    for i, (args, target) in enumerate(micro_batches):
        with reference.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(reference(*args), target) / len(micro_batches)).backward()
    torch_opt.step()


def differences(ddp, reference):
    """({parameter name: max |ours - torch's|}, [names of buffers that differ]) on this rank."""
    ddp.finish_param_sync()  # overlap_param_gather defers the all-gather of the new weights to the next forward
    with ddp.full_parameters():
        ours = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    theirs = dict(reference.module.named_parameters())
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    diffs = {n: (ours[n] - theirs[n]).abs().max().item() for n in theirs}
    their_buffers = dict(reference.module.named_buffers())
    our_buffers = dict(ddp.module.named_buffers())
    assert our_buffers.keys() == their_buffers.keys()
    return diffs, sorted(n for n, b in our_buffers.items() if not torch.equal(b, their_buffers[n]))


def _compare_worker(case_name, config_name, case=None):
    import torch.distributed as dist

    rank = dist.get_rank()
    case = case or CASES[case_name]
    ddp, opt, reference, torch_opt = build_pair(case, *CONFIGS[config_name])
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = []
    for step in range(STEPS):
        micro_batches = [case.batch(gen, rank, step) for _ in range(MICRO_BATCHES)]
        megatron_step(ddp, opt, case.loss, micro_batches)
        torch_step(reference, torch_opt, case.loss, micro_batches)
        per_step.append(differences(ddp, reference))
    return per_step


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_ddp_and_adamw(case, config):
    """Would catch, per model: a tied parameter reduced or stepped twice, or its two names split into two
    parameters (tied_lm); BatchNorm statistics that drift from torch DDP's rank-0 broadcast, or a buffer
    broadcast that runs under no_sync (resnet_bn); frozen parameters trained, decayed, or shifting the buffer
    layout of the trainable ones (lora_frozen_base); ranks running different branches pairing the wrong
    gradients or ZeRO-3 gathers, or a branch's gradient dropped (rank_branches); any gradient or update error
    on a Llama block stack (GQA, rotary, RMSNorm, SwiGLU); blocks reached only through nn.Sequential / a plain
    list (sequential_list) -- each under every sharding strategy, with and without overlapped buckets."""
    if CASES[case].requires:
        pytest.importorskip(CASES[case].requires)
    for rank, per_step in enumerate(run_distributed(_compare_worker, 2, case, config)):
        assert_matches(rank, per_step)


def assert_matches(rank, per_step):
    for step, (diffs, buffers) in enumerate(per_step):
        wrong = {n: d for n, d in diffs.items() if d != 0.0}
        assert not wrong, f"rank {rank} step {step}: parameters differ from torch's (max abs diff): {wrong}"
        assert not buffers, f"rank {rank} step {step}: buffers differ from torch's: {buffers}"


# ------------------------------------------------------------------------------ ZeRO-3 units without nn.ModuleList
def _default_units_worker(case_name):
    try:
        build_pair(replace(CASES[case_name], units=None), "optim_grads_params", True)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,unit_class", [("resnet_bn", "BasicBlock"), ("sequential_list", "ResidualMLP")])
def test_zero3_default_units_without_module_list_is_an_error(case, unit_class):
    """Would catch ZeRO-3 silently gathering a whole model that has no nn.ModuleList (no memory saved) instead
    of the documented ValueError, raised on every rank, naming fsdp_unit_modules and the candidate block class."""
    for error in run_distributed(_default_units_worker, 2, case):
        assert error is not None and "fsdp_unit_modules" in error and unit_class in error, error


def _whole_model_worker(case_name):
    return _compare_worker(case_name, "optim_grads_params", replace(CASES[case_name], units=()))


@pytest.mark.parametrize("case", ["resnet_bn", "sequential_list"])
def test_zero3_whole_model_as_one_unit_matches_torch(case):
    """Would catch fsdp_unit_modules=() (the documented way to gather a model without nn.ModuleList at once)
    leaving parameters unsharded, ungathered or released too early: same bit-exact comparison as above."""
    for rank, per_step in enumerate(run_distributed(_whole_model_worker, 2, case)):
        assert_matches(rank, per_step)


def _tied_across_units_worker(units):
    try:
        return _compare_worker("tied_lm", "optim_grads_params", replace(CASES["tied_lm"], units=units))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("units", [("Linear",), ("Embedding",)], ids=["head_is_a_unit", "embedding_is_a_unit"])
def test_zero3_tied_parameter_shared_by_a_unit_and_the_root(units):
    """Would catch a tied parameter given to the one unit that holds it while the root (a module outside every
    unit) uses it too: the root then reads the released NaN placeholder (found by this file: NaN from the first
    forward). Correct: the parameter gathered with the root (bit-exact vs torch), or a ValueError naming it."""
    for rank, result in enumerate(run_distributed(_tied_across_units_worker, 2, units)):
        if isinstance(result, str):
            assert "embed.weight" in result, result
        else:
            assert_matches(rank, result)


# ------------------------------------------------------------------------------ a branch no rank uses
ALL_RANKS_TASKS = [lambda rank: rank, lambda rank: 0, lambda rank: 1 - rank, lambda rank: 0]
"""Per step, the task each rank runs: in steps 1 and 3 branch_b is used by no rank at all."""


def _unused_everywhere_worker(strategy):
    import torch.distributed as dist

    rank = dist.get_rank()
    case = CASES["rank_branches"]
    ddp, opt, reference, torch_opt = build_pair(case, strategy, True)
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = []
    for step, task_of in enumerate(ALL_RANKS_TASKS):
        micro_batches = []
        for _ in range(MICRO_BATCHES):
            (x, _), y = task_batch(gen, rank, step)
            micro_batches.append(((x, task_of(rank)), y))
        megatron_step(ddp, opt, case.loss, micro_batches)
        torch_step(reference, torch_opt, case.loss, micro_batches)
        diffs, _ = differences(ddp, reference)
        unused = sorted(ddp.param_to_name[p] for p in ddp.unused_params)
        per_step.append(({n: d for n, d in diffs.items() if d != 0.0}, unused))
    return per_step


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_parameters_no_rank_uses_are_skipped_like_torch(strategy):
    """Would catch a branch that no rank runs in a step being stepped anyway (Adam moments keep moving, weight
    decay shrinks it) where torch skips a parameter whose .grad is None, or ddp.unused_params not naming exactly
    that branch."""
    results = run_distributed(_unused_everywhere_worker, 2, strategy)
    for rank, per_step in enumerate(results):
        for step, (wrong, unused) in enumerate(per_step):
            tasks = {ALL_RANKS_TASKS[step](r) for r in range(len(results))}
            assert wrong == {}, (strategy, rank, step, wrong)
            assert bool(unused) == (tasks == {0}) and all(n.startswith("branch_b.") for n in unused), unused
