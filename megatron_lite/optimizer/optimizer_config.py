"""Optimizer configuration (field names and meanings follow megatron.core.optimizer.OptimizerConfig)."""

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class OptimizerConfig:
    """What `get_megatron_optimizer` builds; validated on construction."""

    optimizer: str = "adam"
    """'adam' (decoupled weight decay, i.e. AdamW) or 'sgd' (with momentum, coupled weight decay)."""

    lr: Optional[float] = None
    """Peak learning rate (the scheduler may change each group's 'lr'). None, as in megatron-core: the
    learning-rate scheduler sets it (step() raises if nothing did)."""

    min_lr: Optional[float] = None
    """Floor of the learning-rate schedule (used by the scheduler, not by the optimizer)."""

    weight_decay: float = 0.01
    """Weight decay; biases and other 1-D parameters never get any."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-08
    """Adam's denominator epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    fp16: bool = False
    """Parameters are fp16: keep fp32 main params and use loss scaling."""

    bf16: bool = False
    """Parameters are bf16: keep fp32 main params (no loss scaling needed)."""

    params_dtype: Optional[torch.dtype] = None
    """dtype of most model parameters; None derives it from fp16 / bf16 (a model may mix in fp32
    parameters, e.g. norms or routers, with any setting)."""

    loss_scale: Optional[float] = None
    """Constant loss scale (fp16 or bf16, as in Megatron); None: dynamic loss scaling with fp16, none with bf16."""

    initial_loss_scale: float = 2**32
    """Dynamic loss scaling: starting scale."""

    min_loss_scale: float = 1.0
    """Dynamic loss scaling: the scale never backs off below this."""

    loss_scale_window: float = 1000
    """Dynamic loss scaling: clean steps before the scale doubles."""

    hysteresis: int = 2
    """Dynamic loss scaling: overflowing steps tolerated before the scale halves."""

    use_distributed_optimizer: bool = False
    """Shard main params and optimizer state across data-parallel ranks (needs DDP's matching flag)."""

    optimizer_cpu_offload: bool = False
    """Keep the fp32 main params and the optimizer state in host memory and step them on the CPU
    (cpu_offload.py): the accelerator keeps only the model's params and grads."""

    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the main-param elements that live on the host (whole
    tensors, in order). 1.0 as Megatron's --optimizer-offload-fraction (megatron-core's config says 0.0)."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping (the norm is still reported)."""

    log_num_zeros_in_grad: bool = False
    """Count zero gradient elements each step (returned by step())."""

    log_grad_norm: bool = True
    """megatron-lite extension: compute the global gradient norm even when clip_grad is 0 (Megatron always
    does, for the log line). False skips that pass over the gradients, and its all-reduce, when not
    clipping: step() then returns None for the norm."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or self.lr < 0):
            raise ValueError(f"lr must be a non-negative number or None (set by the scheduler), got {self.lr!r}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (math.inf if self.lr is None else self.lr):
            raise ValueError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        if not 0.0 <= self.sgd_momentum < 1.0:
            raise ValueError(f"sgd_momentum must be in [0, 1), got {self.sgd_momentum}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are mutually exclusive")
        expected = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
        if self.params_dtype is None:
            self.params_dtype = expected
        if self.params_dtype != expected:
            raise ValueError(
                f"params_dtype {self.params_dtype} does not match fp16={self.fp16}, bf16={self.bf16} "
                f"(expected {expected})"
            )
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be > 0, got {self.loss_scale}")
        if self.loss_scale is not None and not (self.fp16 or self.bf16):
            raise ValueError("loss_scale only applies with fp16=True or bf16=True")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError("initial_loss_scale and min_loss_scale must be > 0")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale}) must not exceed initial_loss_scale ({self.initial_loss_scale})"
            )
        if self.loss_scale_window < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {self.loss_scale_window}")
        if not isinstance(self.hysteresis, int) or self.hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}")
