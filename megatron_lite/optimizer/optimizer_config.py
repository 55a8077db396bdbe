"""Optimizer configuration (field names and meanings follow megatron.core.optimizer.OptimizerConfig)."""

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from ..config_checks import Check, check_fields, is_int
from .elementwise import optimizer_kind
from .muon import COEFFICIENT_SETS, SCALE_MODES, ns_steps_rule


@dataclass
class OptimizerConfig:
    """What `get_megatron_optimizer` builds; validated on construction."""

    optimizer: str = "adam"
    """'adam' (torch.optim.AdamW: decoupled weight decay), 'sgd' (torch.optim.SGD with momentum, coupled
    weight decay) or 'muon' (Muon on the 2-D weight matrices, AdamW on the rest: optimizer/muon.py);
    optimizer_class, when set, is built instead."""

    optimizer_class: Optional[type] = None
    """As torch's ZeroRedundancyOptimizer's optimizer_class (pretrain_gpt.py: --optimizer-class): any
    elementwise torch.optim class, e.g. torch.optim.NAdam, built with lr, weight_decay and optimizer_kwargs. Checked at
    construction by a probe (optimizer/elementwise.py): a class whose update is not elementwise is refused."""

    optimizer_kwargs: Optional[dict] = None
    """With optimizer_class: its other hyperparameters, e.g. {'betas': (0.9, 0.95)} (not lr or
    weight_decay: the fields above set those). The adam_* and sgd_* fields are then not read."""

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

    muon_momentum: float = 0.95
    """Muon's momentum: buf = lerp(buf, grad, 1 - muon_momentum) (megatron-core's config default; Megatron's
    --muon-momentum defaults to 0.9)."""

    muon_nesterov: bool = False
    """Muon: orthogonalize lerp(grad, buf, muon_momentum) instead of buf (torch.optim.Muon's default is True)."""

    muon_split_qkv: bool = True
    """Muon: orthogonalize the query, key and value rows of each fused linear_qkv weight as three matrices
    (the parameter's matrix_row_splits, set by models/gpt.py)."""

    muon_scale_mode: str = "spectral"
    """Muon's update scale per matrix of rows x cols: 'spectral' sqrt(max(rows, cols)), 'unit_rms_norm'
    sqrt(rows / cols), 'shape_scaling' sqrt(max(1, rows / cols)) (torch.optim.Muon's default)."""

    muon_coefficient_type: str = "quintic"
    """Muon's Newton-Schulz coefficients per iteration: 'simple' (torch.optim.Muon's), 'quintic', 'polar_express'
    or 'aol' (optimizer/muon.py COEFFICIENT_SETS)."""

    muon_num_ns_steps: int = 5
    """Muon's Newton-Schulz iterations (>= 1; a multiple of 5 for 'quintic', of 4 for 'aol', >= 8 for
    'polar_express')."""

    muon_extra_scale_factor: float = 1.0
    """Muon: multiplies the scale of muon_scale_mode (0.2 with 'spectral' is torch's 'match_rms_adamw')."""

    muon_scalar_optimizer: str = "adam"
    """Muon: the optimizer of the parameters Muon does not step (1-D, embeddings, output layer): 'adam'
    (torch.optim.AdamW with adam_beta1/2, adam_eps and the weight-decay groups)."""

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
        if self.params_dtype is None:
            self.params_dtype = self._precision_dtype
        check_fields(self, _RULES)
        if self.optimizer_class is not None:  # the probe (cached) refuses a class it cannot shard, here
            optimizer_kind(self)

    @property
    def _precision_dtype(self) -> torch.dtype:
        """The parameters' dtype that fp16 / bf16 say."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def _muon_steps_rule(self) -> str:
        """What muon_coefficient_type asks of muon_num_ns_steps, in words (for the error)."""
        return ns_steps_rule(self.muon_coefficient_type)[1]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_FINITE = Check(lambda v: not isinstance(v, float) or math.isfinite(v), "{name} must be a finite number, got {value}")
_FRACTION = Check(lambda v: 0.0 <= v < 1.0, "{name} must be in [0, 1), got {value}")

# __post_init__ walks this table in order (config_checks.py): no field may be inf or nan, then each field's
# range, with the rules across fields where their fields come up. The comparisons are written as the error
# says (`not v < 0` for ">= 0"), so a value of the wrong type fails as it always did.
_RULES = tuple((f.name, (_FINITE,)) for f in fields(OptimizerConfig)) + (
    ("optimizer", (Check(lambda v: v in ("adam", "sgd", "muon"),
                         "{name} must be 'adam', 'sgd' or 'muon', got {value!r}"),)),
    (None, (Check(lambda c: c.optimizer_class is not None or c.optimizer_kwargs is None,
                  "optimizer_kwargs is for optimizer_class (set it, or use the adam_* / sgd_* fields)"),
            Check(lambda c: c.optimizer_class is None or c.optimizer == "adam",
                  "optimizer={config.optimizer!r} and optimizer_class both name the optimizer: leave optimizer at "
                  "its default when passing optimizer_class"))),
    ("optimizer_kwargs", (Check(lambda v: v is None or isinstance(v, dict),
                                "{name} must be a dict or None, got {value!r}"),)),
    ("lr", (Check(lambda v: v is None or (_is_number(v) and v >= 0),
                  "{name} must be a non-negative number or None (set by the scheduler), got {value!r}"),)),
    (None, (Check(lambda c: c.min_lr is None or 0 <= c.min_lr <= (math.inf if c.lr is None else c.lr),
                  "min_lr must be between 0 and lr ({config.lr}), got {config.min_lr}"),)),
    ("weight_decay", (Check(lambda v: not v < 0, "{name} must be >= 0, got {value}"),)),
    (("adam_beta1", "adam_beta2"), (_FRACTION,)),
    ("adam_eps", (Check(lambda v: not v <= 0, "{name} must be > 0, got {value}"),)),
    ("sgd_momentum", (_FRACTION,)),
    ("muon_momentum", (_FRACTION,)),
    (("muon_nesterov", "muon_split_qkv"), (Check(lambda v: isinstance(v, bool), "{name} must be a bool, got {value!r}",
                                                 TypeError),)),
    ("muon_scale_mode", (Check(lambda v: v in SCALE_MODES, f"{{name}} must be one of {list(SCALE_MODES)}, got "
                                                           f"{{value!r}}"),)),
    ("muon_coefficient_type", (Check(lambda v: v in COEFFICIENT_SETS, f"{{name}} must be one of "
                                                                      f"{list(COEFFICIENT_SETS)}, got {{value!r}}"),)),
    ("muon_num_ns_steps", (Check(lambda v: is_int(v), "{name} must be an int, got {value!r}", TypeError),
                           Check(lambda v: 1 <= v < 100, "{name} must be in [1, 100), got {value}"))),
    (None, (Check(lambda c: ns_steps_rule(c.muon_coefficient_type)[0](c.muon_num_ns_steps),
                  "muon_num_ns_steps must be {config._muon_steps_rule} with muon_coefficient_type "
                  "{config.muon_coefficient_type!r}, got {config.muon_num_ns_steps}"),)),
    ("muon_extra_scale_factor", (Check(lambda v: _is_number(v) and v > 0,
                                       "{name} must be a number > 0, got {value!r}"),)),
    ("muon_scalar_optimizer", (Check(lambda v: v == "adam", "{name} must be 'adam' (AdamW; Megatron's 'lion' is not "
                                                            "available here), got {value!r}"),)),
    (None, (Check(lambda c: not (c.optimizer == "muon" and c.optimizer_cpu_offload),
                  "optimizer='muon' does not support optimizer_cpu_offload: turn one of them off"),)),
    (None, (
        Check(lambda c: not (c.fp16 and c.bf16), "fp16 and bf16 are mutually exclusive"),
        Check(lambda c: c.params_dtype == c._precision_dtype,
              "params_dtype {config.params_dtype} does not match fp16={config.fp16}, bf16={config.bf16} "
              "(expected {config._precision_dtype})"),
    )),
    ("loss_scale", (Check(lambda v: v is None or not v <= 0, "{name} must be > 0, got {value}"),)),
    (None, (
        Check(lambda c: c.loss_scale is None or c.fp16 or c.bf16,
              "loss_scale only applies with fp16=True or bf16=True"),
        Check(lambda c: not (c.initial_loss_scale <= 0 or c.min_loss_scale <= 0),
              "initial_loss_scale and min_loss_scale must be > 0"),
        Check(lambda c: not c.min_loss_scale > c.initial_loss_scale,
              "min_loss_scale ({config.min_loss_scale}) must not exceed initial_loss_scale "
              "({config.initial_loss_scale})"),
    )),
    ("loss_scale_window", (Check(lambda v: not v < 1, "{name} must be >= 1, got {value}"),)),
    ("hysteresis", (Check(lambda v: isinstance(v, int) and not v < 1, "{name} must be an int >= 1, got {value!r}"),)),
    ("clip_grad", (Check(lambda v: not v < 0, "{name} must be >= 0 (0 disables clipping), got {value}"),)),
    ("optimizer_offload_fraction", (Check(lambda v: 0.0 <= v <= 1.0, "{name} must be in [0, 1], got {value}"),)),
)
