"""save_checkpoint / load_checkpoint on models nobody here wrote (third_party_models.py and a few more traps):
trained 2 steps on 2 gloo ranks under one sharding strategy, saved, loaded into a freshly built model (other
initial weights) under another strategy, trained 2 more steps. Every parameter and every buffer must then be
bitwise those of the uninterrupted run (fp32, dp=2: every strategy computes the same numbers, see
tests/distributed/test_third_party_models.py), in both formats.

The traps: a tied weight (two names, one parameter), BatchNorm running statistics (buffers that differ
between the ranks until the next forward broadcasts rank 0's), a frozen base with LoRA adapters, rotary
tables (non-persistent buffers), ModuleDict keys, a zero-size parameter, weight_norm's parametrizations, a
bf16 layer among fp32 ones, the same names registered in another order, fp16 loss-scaler state.
"""

import contextlib

import pytest
import third_party_models as tpm
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed_helper import run_distributed

VOCAB, SEQ, LR, WD = 32, 8, 1e-2, 0.1


def lm_batch(gen):
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def image_batch(gen):
    return torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def regression_batch(gen):
    return torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)


class Heads(nn.Module):
    """Parameters under ModuleDict keys, a zero-size parameter, a persistent and a non-persistent buffer."""

    def __init__(self, reordered=False):
        super().__init__()
        parts = [("trunk", nn.Linear(6, 8)), ("heads", nn.ModuleDict({"task_a": nn.Linear(8, 2),
                                                                      "task_b": nn.Linear(8, 2)})),
                 ("empty", nn.Parameter(torch.zeros(0)))]
        if reordered:  # the same names registered in another order: another layout in the buffers
            parts[1][1]["task_a"] = parts[1][1].pop("task_a")
            parts.reverse()
        for name, part in parts:
            setattr(self, name, part)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, x):
        self.seen += 1
        h = torch.tanh(self.trunk(x))
        return self.heads["task_a"](h) + self.heads["task_b"](h) + self.empty.sum()


class WeightNormed(nn.Module):
    """torch.nn.utils.parametrizations.weight_norm: parameters named `parametrizations.weight.original0/1`."""

    def __init__(self):
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(6, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


class MixedDtypes(nn.Module):
    """A bf16 layer next to fp32 ones (a model cast in part, as mixed-precision recipes do)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8).to(torch.bfloat16)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.mid(torch.tanh(self.fc(x)).bfloat16()).float())


CASES = {
    "weight_norm": (WeightNormed, regression_batch, F.mse_loss, ("Linear",)),
    "mixed_dtypes": (MixedDtypes, regression_batch, F.mse_loss, ("Linear",)),
    "tied_lm": (tpm.TiedLM, lm_batch, lm_loss, None),
    "resnet_bn": (tpm.tiny_resnet, image_batch, F.cross_entropy, ("BasicBlock",)),
    "lora_frozen_base": (tpm.lora_mlp, regression_batch, F.mse_loss, None),
    "llama_gqa_rope": (tpm.TinyLlama, lm_batch, lm_loss, None),
    "heads": (Heads, regression_batch, F.mse_loss, ("Linear",)),
    "heads_reordered": (lambda: Heads(reordered=True), regression_batch, F.mse_loss, ("Linear",)),
}


def _build(case, strategy, seed, fp16=False):
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    build, _, _, units = CASES[case]
    torch.manual_seed(seed)
    sharded = strategy != "no_shard"
    model = build().half() if fp16 else build()
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=64,
        fsdp_unit_modules=units if strategy == "optim_grads_params" else None))
    # fp16: an initial scale that overflows, so that the resumed run must restore the scaler's trackers.
    scaling = dict(fp16=True, initial_loss_scale=2.0**40, hysteresis=2, loss_scale_window=3) if fp16 else {}
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0,
                                                 use_distributed_optimizer=sharded, **scaling), [ddp])
    return ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")


def _steps(case, ddp, opt, first, count):
    """Train; the list of skipped steps (fp16 overflows)."""
    import torch.distributed as dist

    skipped = []
    _, batch, loss, _ = CASES[case]
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        micro = [batch(gen) for _ in range(2)]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                opt.scale_loss(loss(ddp(x).float(), y) / 2).backward()
        ddp.finish_grad_sync()
        skipped.append(not opt.step()[0])
    return skipped


def _state(ddp):
    ddp.finish_param_sync()
    with ddp.full_parameters():
        out = {f"param {n}": p.detach().clone() for n, p in ddp.module.named_parameters()}
    out.update({f"buffer {n}": b.clone() for n, b in ddp.module.named_buffers()})
    return out


def _resume_worker(root, case, save_strategy, load_strategy, fmt, load_case=None, fp16=False):
    """Uninterrupted 4 steps vs 2 steps, save, load into a fresh model, 2 steps: the names that differ, and
    (fp16) the skipped steps and loss scaler of both runs."""
    from megatron_lite import checkpointing

    ddp, opt, sched = _build(case, save_strategy, seed=0, fp16=fp16)
    skipped = _steps(case, ddp, opt, 0, 2)
    checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 16, ckpt_format=fmt)
    skipped += _steps(case, ddp, opt, 2, 2)
    straight, scaler = _state(ddp), opt.grad_scaler and opt.grad_scaler.state_dict()
    ddp, opt, sched = _build(load_case or case, load_strategy, seed=1, fp16=fp16)
    checkpointing.load_checkpoint(root, ddp, opt, sched)
    resumed_skipped = skipped[:2] + _steps(case, ddp, opt, 2, 2)
    resumed = _state(ddp)
    assert straight.keys() == resumed.keys()
    diff = sorted(k for k in straight if not torch.equal(straight[k], resumed[k]))
    if not fp16:
        assert not any(skipped + resumed_skipped)
        return diff
    return diff, (skipped, scaler), (resumed_skipped, opt.grad_scaler.state_dict())


PAIRS = [("no_shard", "optim_grads_params"), ("optim_grads_params", "optim"), ("optim", "optim_grads"),
         ("optim_grads", "no_shard")]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("pair", PAIRS, ids=["-to-".join(p) for p in PAIRS])
@pytest.mark.parametrize("case", sorted(set(CASES) - {"heads_reordered"}))
def test_resume_across_strategies_bitwise(tmp_path, case, pair, fmt):
    """Would catch a tied weight, frozen parameter, buffer, ModuleDict entry or zero-size parameter lost,
    permuted or left at its fresh value by a save under one strategy and a load under another. Found in
    torch_dist: BatchNorm statistics saved from whichever rank DCP picked (rank 1's, not the rank-0 copy
    DDP broadcasts next); a tied weight's second name saved from ZeRO-3's empty placeholder (garbage, refused
    as NaN when lucky) and loaded into one (a load_state_dict error); a zero-size parameter that no ZeRO-3
    rank wrote ("saved from another model") and whose optimizer state no sharded optimizer wrote."""
    for rank, diff in enumerate(run_distributed(_resume_worker, 2, str(tmp_path), case, *pair, fmt)):
        assert not diff, (rank, diff)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("pair", PAIRS, ids=["-to-".join(p) for p in PAIRS])
def test_load_into_model_with_another_parameter_order(tmp_path, pair, fmt):
    """The same names registered in another order: would catch a load that matches tensors by position (the
    buffer layout, the optimizer's parameter list) instead of by name, silently permuting the weights."""
    for rank, diff in enumerate(run_distributed(_resume_worker, 2, str(tmp_path), "heads", *pair, fmt,
                                                load_case="heads_reordered")):
        assert not diff, (rank, diff)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_fp16_loss_scaler_state_resumes(tmp_path, fmt):
    """fp16 with an initial loss scale that overflows (steps skipped, hysteresis consumed, the scale halved):
    would catch the dynamic scaler's scale or trackers lost at a save under ZeRO-3 and a load under ZeRO-1
    (the resumed run would skip other steps or scale by another factor)."""
    for rank, (diff, straight, resumed) in enumerate(run_distributed(
            _resume_worker, 2, str(tmp_path), "tied_lm", "optim_grads_params", "optim", fmt, fp16=True)):
        assert any(straight[0]), (rank, straight)  # the trap is set: some step overflowed
        assert resumed == straight, (rank, straight, resumed)
        assert not diff, (rank, diff)


def _non_persistent_worker(root, save_strategy, load_strategy, fmt):
    """A non-persistent buffer set in the loading model: its value after the load."""
    from megatron_lite import checkpointing

    ddp, opt, sched = _build("heads", save_strategy, seed=0)
    _steps("heads", ddp, opt, 0, 1)
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8, ckpt_format=fmt)
    ddp, opt, sched = _build("heads", load_strategy, seed=1)
    ddp.module.cache.fill_(7.0)
    checkpointing.load_checkpoint(root, ddp, opt, sched)
    return ddp.module.cache.tolist(), ddp.module.seen.item()


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_non_persistent_buffers_are_left_alone(tmp_path, fmt):
    """Would catch a load that resets (or a save that records) a buffer registered with persistent=False,
    which module.state_dict() leaves out, while the persistent one is restored."""
    for rank, (cache, seen) in enumerate(run_distributed(_non_persistent_worker, 2, str(tmp_path), "optim",
                                                         "optim_grads_params", fmt)):
        assert cache == [7.0] * 3 and seen == 2.0, (rank, cache, seen)


def _last_words_worker(root, case):
    """LastWords (what pretrain() keeps when --save is given) for `case` under ZeRO-1: the error, or None."""
    from megatron_lite.checkpointing import LastWords

    ddp, opt, sched = _build(case, "optim", seed=0)
    try:
        LastWords(root, opt, sched, 0, 0)
    except ValueError as e:
        return str(e)
    return None


def test_last_words_refuse_models_with_persistent_buffers(tmp_path):
    """Last words rebuild the model from the optimizer's shards and take everything else from the model
    provider. Would catch BatchNorm running statistics (persistent buffers that training changes, and that
    differ per rank) silently reset to their initial values by a restart from last words; a model whose
    buffers are all non-persistent (the rotary tables) keeps them."""
    for rank, error in enumerate(run_distributed(_last_words_worker, 2, str(tmp_path), "resnet_bn")):
        assert error is not None and "--no-last-words" in error and "1.running_mean" in error, (rank, error)
    assert run_distributed(_last_words_worker, 2, str(tmp_path), "llama_gqa_rope") == [None, None]


def _heal_worker(case):
    """Live recovery's heal() (every generation's start) for `case` under ZeRO-1: the error, or what it returned."""
    from megatron_lite.fault_tolerance.healing import heal

    ddp, opt, sched = _build(case, "optim", seed=0)
    try:
        return heal(None, ddp, opt, sched)
    except ValueError as e:
        return str(e)


def test_live_recovery_refuses_models_with_persistent_buffers():
    """A replacement is healed from the optimizer's shards and the model provider, as last words are. Would
    catch a replacement's BatchNorm statistics silently reset while the survivors keep theirs; a model whose
    buffers are all non-persistent heals (nothing to heal here: None on every rank)."""
    for rank, error in enumerate(run_distributed(_heal_worker, 2, "resnet_bn")):
        assert error is not None and "torchrun" in error and "1.running_mean" in error, (rank, error)
    assert run_distributed(_heal_worker, 2, "llama_gqa_rope") == [None, None]


def _converted_worker(root, converted, strategy):
    """tied_lm saved as torch_dist, converted to 'torch' by tools/checkpoint_convert.py, loaded, trained:
    the names that differ from the uninterrupted run."""
    import os
    import sys

    import torch.distributed as dist
    from pretrain_testing import REPO

    from megatron_lite import checkpointing

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    ddp, opt, sched = _build("tied_lm", strategy, seed=0)
    _steps("tied_lm", ddp, opt, 0, 2)
    checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 16, ckpt_format="torch_dist")
    _steps("tied_lm", ddp, opt, 2, 2)
    straight = _state(ddp)
    if dist.get_rank() == 0:
        checkpoint_convert.write(converted, checkpoint_convert.read(f"{root}/iter_0000002"), "torch")
    dist.barrier()
    ddp, opt, sched = _build("tied_lm", strategy, seed=1)
    checkpointing.load_checkpoint(converted, ddp, opt, sched)
    _steps("tied_lm", ddp, opt, 2, 2)
    resumed = _state(ddp)
    return sorted(k for k in straight if not torch.equal(straight[k], resumed[k]))


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_tied_weights_survive_conversion_to_torch_format(tmp_path, strategy):
    """A torch_dist checkpoint keeps a tied weight under its parameter's name only: would catch the 'torch'
    format, after tools/checkpoint_convert.py, refusing the checkpoint for lacking the weight's second name
    (or loading it without the tie's value)."""
    for rank, diff in enumerate(run_distributed(_converted_worker, 2, str(tmp_path / "a"), str(tmp_path / "b"),
                                                strategy)):
        assert not diff, (rank, diff)


def _unfrozen_lora():
    model = tpm.lora_mlp()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


CASES["lora_unfrozen"] = (_unfrozen_lora, regression_batch, F.mse_loss, None)


def _refreeze_worker(root, saved_case, loaded_case, save_strategy, load_strategy, fmt):
    """`saved_case` trained a step and saved, loaded into `loaded_case` (the same names, other parameters
    trainable) with finetune=True: the names whose values differ from the saved ones, or the error."""
    from megatron_lite import checkpointing

    ddp, opt, sched = _build(saved_case, save_strategy, seed=0)
    _steps(saved_case, ddp, opt, 0, 1)
    checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8, ckpt_format=fmt)
    saved = _state(ddp)
    ddp, opt, sched = _build(loaded_case, load_strategy, seed=1)
    try:
        checkpointing.load_checkpoint(root, ddp, opt, sched, finetune=True)
    except ValueError as e:
        return str(e)
    loaded = _state(ddp)
    return sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))


REFREEZE = [("lora_unfrozen", "lora_frozen_base", "optim", "optim"),
            ("lora_unfrozen", "lora_frozen_base", "optim_grads_params", "no_shard"),
            ("lora_frozen_base", "lora_unfrozen", "optim", "no_shard")]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("config", REFREEZE, ids=["-".join(c) for c in REFREEZE])
def test_finetune_with_other_parameters_frozen(tmp_path, config, fmt):
    """Pre-train everything, then fine-tune with the base frozen (LoRA), or the other way round, with
    --finetune: would catch torch_dist storing a trained parameter flat and a frozen one whole, so that the
    same weight could not be read back once its requires_grad changed (a DCP size-mismatch traceback)."""
    for rank, result in enumerate(run_distributed(_refreeze_worker, 2, str(tmp_path), *config, fmt)):
        assert result == [], (rank, result)


def test_unfrozen_weight_into_zero3_is_a_clear_error(tmp_path):
    """A weight frozen when saved (stored whole) cannot be read as ZeRO-3 shards: would catch DCP's size-
    mismatch traceback instead of an error naming the weight and what to do, on every rank."""
    for rank, result in enumerate(run_distributed(_refreeze_worker, 2, str(tmp_path), "lora_frozen_base",
                                                  "lora_unfrozen", "optim", "optim_grads_params", "torch_dist")):
        assert ".base.weight" in result and "ZeRO-3 cannot read" in result, (rank, result)
