"""Optimizers (mirrors megatron.core.optimizer): fp32, fp16/bf16 with fp32 main params, and ZeRO-1."""

from typing import List

import torch

from ..distributed import DistributedDataParallel
from .distrib_optimizer import DistributedOptimizer
from .elementwise import OptimizerKind, optimizer_kind
from .full_param_optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, make_grad_scaler
from .muon import MuonWithAdamW, matrix_specs
from .optimizer import MegatronOptimizer
from .optimizer_config import OptimizerConfig

__all__ = [
    "OptimizerConfig", "get_megatron_optimizer", "check_optimizer_matches_ddp", "MegatronOptimizer", "FP32Optimizer",
    "Float16OptimizerWithFloat16Params", "DistributedOptimizer", "ConstantGradScaler", "DynamicGradScaler",
    "OptimizerKind", "optimizer_kind", "no_weight_decay",
]


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule (megatron-core's _get_param_groups): biases and other 1-D parameters take no weight decay
    (wd_mult 0). Also what Megatron-LM checkpoints' param groups follow (checkpointing/megatron_read, _write)."""
    return name.endswith(".bias") or param.dim() == 1


def _get_param_groups(model_chunks, config: OptimizerConfig) -> List[dict]:
    """Two groups, Megatron's rule: no weight decay for biases and other 1-D parameters. optimizer='muon' splits
    them again by Muon's rule (muon.matrix_specs): each group has 'use_muon', Muon's first."""
    on_muon = {p for p, spec in matrix_specs(model_chunks, config).items() if spec is not None} \
        if config.optimizer == "muon" else None
    groups = {}
    for chunk in model_chunks:
        for param, name in chunk.param_to_name.items():
            wd_mult = 0.0 if no_weight_decay(name, param) else 1.0
            use_muon = None if on_muon is None else param in on_muon
            group = groups.setdefault((bool(use_muon), wd_mult), {
                "params": [], "wd_mult": wd_mult, "lr_mult": 1.0, "weight_decay": config.weight_decay * wd_mult,
                **({} if use_muon is None else {"use_muon": use_muon})})
            group["params"].append(param)
    return [groups[k] for k in sorted(groups, reverse=True)]


def _inner_optimizer_factory(config: OptimizerConfig, device: torch.device):
    """The inner optimizer's class (optimizer_kind: 'adam' -> AdamW, 'sgd' -> SGD, or config.optimizer_class,
    probed elementwise). For the named two: NVIDIA apex's fused kernels when importable (CUDA), else torch's:
    fused on CUDA, foreach on CPU (fused for optimizer_cpu_offload). optimizer_class is built with the
    kernel options its optimizer_kwargs give (torch's defaults otherwise)."""
    kind = optimizer_kind(config)
    apex_optimizers = None
    if device.type == "cuda" and not config.optimizer_cpu_offload and config.optimizer_class is None:
        try:  # NVIDIA apex only; the unrelated PyPI package named `apex` has no `apex.optimizers`.
            import apex.optimizers as apex_optimizers
        except ImportError:
            apex_optimizers = None
    # Offloaded main params are stepped by torch's fused CPU kernels (Megatron's choice too); torch groups
    # the tensors by device, so a partial offload steps the rest on the device with the same optimizer.
    kernel = {}
    if config.optimizer_class is None:
        kernel = {"fused": True} if device.type == "cuda" or config.optimizer_cpu_offload else {"foreach": True}

    def make(groups):
        inner = _make(groups)
        if config.lr is None:  # megatron-core: the scheduler sets each group's lr; step() checks it did
            for group in inner.param_groups:
                group["lr"] = None
        return inner

    def _make(groups):
        lr = 0.0 if config.lr is None else config.lr  # torch validates a number at construction
        if config.optimizer == "muon":
            return MuonWithAdamW(groups, lr=lr, weight_decay=config.weight_decay, config=config, **kernel)
        if apex_optimizers is not None:
            # apex's kernels index group["params"][0]; a rank's shard may leave a group empty.
            groups = [g for g in groups if g["params"]]
            if config.optimizer == "adam":
                return apex_optimizers.FusedAdam(groups, lr=lr, weight_decay=config.weight_decay,
                                                 betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                                 adam_w_mode=True)
            return apex_optimizers.FusedSGD(groups, lr=lr, weight_decay=config.weight_decay,
                                            momentum=config.sgd_momentum)
        # Each group carries its own weight_decay (_get_param_groups), so the class need not take one; one that
        # does gets it as its default too (as before optimizer_class: a group added later inherits it).
        decay = {"weight_decay": config.weight_decay} if "weight_decay" in kind.hyperparameter_keys else {}
        return kind.cls(groups, lr=lr, **decay, **dict(kind.kwargs), **kernel)

    return make


def check_optimizer_matches_ddp(config: OptimizerConfig, ddp_config) -> None:
    """Raise ValueError when an OptimizerConfig cannot drive a model wrapped with `ddp_config`."""
    if ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
        raise ValueError(
            f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but the model was "
            f"wrapped with DistributedDataParallelConfig.use_distributed_optimizer="
            f"{ddp_config.use_distributed_optimizer}: set both the same"
        )
    if config.fp16 and config.loss_scale is None and ddp_config.check_for_nan_in_grad:
        raise ValueError(
            "check_for_nan_in_grad=True rejects Inf gradients, which fp16=True dynamic loss scaling produces on "
            "purpose (and then skips the step): turn the check off, or set a constant loss_scale"
        )


def get_megatron_optimizer(config: OptimizerConfig, model_chunks) -> MegatronOptimizer:
    """Build the optimizer for DDP-wrapped `model_chunks` (one DistributedDataParallel or a list).

    fp32 params -> FP32Optimizer; fp16/bf16 -> Float16OptimizerWithFloat16Params (fp32 main copies);
    `config.use_distributed_optimizer` -> DistributedOptimizer (sharded main params and state). optimizer='muon':
    the inner optimizer is muon.MuonWithAdamW (Muon on the weight matrices, AdamW on the rest).
    """
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    model_chunks = list(model_chunks)
    if not model_chunks or not all(isinstance(c, DistributedDataParallel) for c in model_chunks):
        raise TypeError("model_chunks must be megatron_lite DistributedDataParallel modules (main_grad lives there)")
    for chunk in model_chunks:
        check_optimizer_matches_ddp(config, chunk.ddp_config)
        for param, name in chunk.param_to_name.items():
            # Any mix of fp32, bf16 and fp16 works (fp32 params are stepped in place, others through fp32 main
            # copies: a wider dtype would lose precision there), but fp16 gradients underflow without loss scaling.
            if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"parameter {name} is {param.dtype}: the optimizers step fp32 main params (as "
                                f"megatron-core's), which would update it at fp32 precision; convert the model to "
                                f"float32, bfloat16 or float16 before wrapping")
            if param.dtype == torch.float16 and not config.fp16:
                raise ValueError(f"parameter {name} is float16 but OptimizerConfig.fp16 is False: fp16 training "
                                 f"needs loss scaling (set fp16=True)")
    groups = _get_param_groups(model_chunks, config)
    device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
    make_inner = _inner_optimizer_factory(config, device)
    grad_scaler = make_grad_scaler(config)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(make_inner, config, model_chunks, groups, grad_scaler)
    cls = Float16OptimizerWithFloat16Params if config.fp16 or config.bf16 else FP32Optimizer
    return cls(make_inner, config, model_chunks, groups, grad_scaler)
