"""Muon's math: which parameters it steps, their matrices, Newton-Schulz, the update's scale.

Muon steps a 2-D weight W (rows x cols) with an orthogonalized momentum (megatron-core's Muon, torch.optim.Muon)::

    buf = lerp(buf, grad, 1 - momentum)                     momentum: elementwise, flat shards like Adam's moments
    u   = lerp(grad, buf, momentum) if nesterov else buf
    O   = newton_schulz(u)                                  needs the WHOLE matrix (each Q/K/V block of a split QKV)
    W   = W * (1 - lr * weight_decay) - lr * scale * extra * O

The parameters Muon does not step (1-D, embeddings, output layer, use_muon=False) go to AdamW. A fused
linear_qkv weight is three matrices stacked as contiguous row blocks [Q; K; V] (models/gpt.py sets
`matrix_row_splits`); with muon_split_qkv each block is orthogonalized and scaled as its own matrix::

    flat element index:  0 ........ q_rows*cols ........ (q_rows+k_rows)*cols ........ rows*cols
                         |   Q block    |      K block       |        V block        |

Newton-Schulz runs torch.optim.Muon's op sequence (bf16, wide orientation, Frobenius normalization, then per
iteration A = X X^T, B = b A + c A A, X = a X + B X) with per-iteration coefficients, so coefficient type
'simple' is bitwise torch.optim.Muon's orthogonalization. Weight decay is torch's p *= 1 - lr * wd (Megatron
adds -lr * wd * p: the same math, other rounding).
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..config_checks import is_int

# Newton-Schulz (a, b, c) per iteration (emerging_optimizers' values, the package megatron-core's Muon uses).
COEFFICIENT_SETS: Dict[str, Tuple[Tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
}

# What each coefficient type asks of the number of steps: (holds, in words). 'simple' repeats its one set;
# 'quintic' and 'aol' repeat the whole list; 'polar_express' runs its list once, then repeats its last set.
_STEPS_RULES: Dict[str, Tuple[Callable[[int], bool], str]] = {
    "simple": (lambda n: n >= 1, ">= 1"),
    "quintic": (lambda n: n % 5 == 0, "a multiple of 5"),
    "polar_express": (lambda n: n >= 8, ">= 8"),
    "aol": (lambda n: n % 4 == 0, "a multiple of 4"),
}

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")

EPS = 1e-7  # torch.optim.Muon's: the Frobenius norm is clamped here before dividing by it


def ns_steps_rule(coefficient_type: str) -> Tuple[Callable[[int], bool], str]:
    """(holds(num_ns_steps), the rule in words) for a coefficient type of COEFFICIENT_SETS."""
    return _STEPS_RULES[coefficient_type]


def ns_coefficients(coefficient_type: str, steps: int) -> Tuple[Tuple[float, float, float], ...]:
    """The (a, b, c) of each of `steps` iterations. Raises ValueError for an unknown type or a count its rule
    refuses."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"muon_coefficient_type must be one of {list(COEFFICIENT_SETS)}, got {coefficient_type!r}")
    holds, words = _STEPS_RULES[coefficient_type]
    if not (isinstance(steps, int) and steps >= 1 and holds(steps)):
        raise ValueError(f"muon_num_ns_steps must be {words} (and >= 1) with muon_coefficient_type "
                         f"{coefficient_type!r}, got {steps!r}")
    sets = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type == "polar_express":
        return sets + (sets[-1],) * (steps - len(sets))
    return tuple(sets[i % len(sets)] for i in range(steps))


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a rows x cols matrix (emerging_optimizers' get_muon_scale_factor): 'shape_scaling'
    is torch.optim.Muon's adjust_lr_fn None / 'original'; 'spectral' times 0.2 is its 'match_rms_adamw'."""
    if mode == "shape_scaling":
        return math.sqrt(max(1, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"muon_scale_mode must be one of {list(SCALE_MODES)}, got {mode!r}")


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str, eps: float = EPS) -> torch.Tensor:
    """The orthogonalization of the 2-D `x` (about U V^T of its SVD), in bfloat16, by torch.optim.Muon's op
    sequence with coefficient_type's (a, b, c) per iteration (ns_coefficients)."""
    if x.dim() != 2:
        raise ValueError(f"newton_schulz takes a 2-D matrix, got shape {tuple(x.shape)}")
    coefficients = ns_coefficients(coefficient_type, steps)
    tall = x.size(0) > x.size(1)
    X = x.bfloat16()
    if tall:  # work on the wide orientation: the Gram matrix X X^T is the small one
        X = X.T
    X = X.div(X.norm().clamp(min=eps))  # out of place: a bf16 x is not a copy
    for a, b, c in coefficients:
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if tall else X


@dataclass(frozen=True)
class MatrixSpec:
    """A parameter Muon steps: its full shape, and the row blocks orthogonalized as separate matrices."""

    rows: int
    """The parameter's rows (param.shape[0]: the full shape, also under ZeRO-3 and a meta build)."""
    cols: int
    """Its columns."""
    row_splits: Tuple[int, ...]
    """Rows of each block, top to bottom, summing to rows; (rows,) when the parameter is one matrix."""

    @property
    def blocks(self) -> Tuple[Tuple[int, int, int], ...]:
        """(first element, end element, rows) of each block in the flattened (row-major) parameter."""
        out, start = [], 0
        for r in self.row_splits:
            out.append((start, start + r * self.cols, r))
            start += r * self.cols
        return tuple(out)

    def scales(self, group: dict) -> Tuple[float, ...]:
        """Each block's update scale times muon_extra_scale_factor, from a Muon param group's (or an
        OptimizerConfig's as dict) values: the ratio the learning rate is multiplied by, formed first as
        torch.optim.Muon forms its adjusted ratio."""
        return tuple(muon_scale_factor(r, self.cols, group["muon_scale_mode"]) * group["muon_extra_scale_factor"]
                     for r in self.row_splits)


def uses_muon(param: torch.Tensor) -> bool:
    """Megatron's rule: Muon steps a parameter whose (full) shape is 2-D, unless it is marked as an embedding or
    output layer (is_embedding_or_output_parameter) or opted out (use_muon=False)."""
    return (len(param.shape) == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            and getattr(param, "use_muon", True) is not False)


def matrix_specs(model_chunks, config) -> Dict[torch.nn.Parameter, Optional[MatrixSpec]]:
    """{param: its MatrixSpec, or None for a parameter AdamW steps} for every parameter that requires grad in
    `model_chunks` (modules; DistributedDataParallel chunks are read through their param_to_name).

    Raises ValueError when no parameter qualifies (Muon would silently be AdamW), for a fused linear_qkv
    weight without matrix_row_splits under muon_split_qkv (the split would be silently skipped), splits that
    do not add up to its rows, or an expert-parallel parameter;
    TypeError for matrix_row_splits that is not a tuple (or list) of ints."""
    specs: Dict[torch.nn.Parameter, Optional[MatrixSpec]] = {}
    for chunk in model_chunks:
        named = (((n, p) for p, n in chunk.param_to_name.items()) if hasattr(chunk, "param_to_name")
                 else chunk.named_parameters())
        for name, param in named:
            if not param.requires_grad or param in specs:
                continue
            if not uses_muon(param):
                specs[param] = None
                continue
            if not getattr(param, "allreduce", True):
                raise ValueError(f"optimizer='muon' does not support expert-parallel parameters ({name}): set "
                                 f"use_muon=False on them (AdamW) or use optimizer='adam'")
            rows, cols = param.shape
            splits = getattr(param, "matrix_row_splits", None)
            if not config.muon_split_qkv or splits is None:
                if config.muon_split_qkv and name.endswith("linear_qkv.weight"):
                    raise ValueError(f"muon_split_qkv: parameter {name} is a fused QKV weight without "
                                     f"matrix_row_splits (its [Q; K; V] row counts), so Muon cannot split it: set "
                                     f"param.matrix_row_splits, or turn the split off (muon_split_qkv=False, "
                                     f"--muon-no-split-qkv)")
                splits = (rows,)
            if not (isinstance(splits, (tuple, list)) and all(is_int(r) for r in splits)):
                raise TypeError(f"parameter {name}: matrix_row_splits must be a tuple of ints (the row count of "
                                f"each block, top to bottom), got {splits!r}")
            splits = tuple(splits)
            if sum(splits) != rows or min(splits) < 1:
                raise ValueError(f"parameter {name}: matrix_row_splits {splits} must be positive row counts adding "
                                 f"up to its {rows} rows")
            specs[param] = MatrixSpec(rows, cols, splits)
    if specs and all(spec is None for spec in specs.values()):
        # DeepSpeed's zero.Init bug: parameters seen as flat placeholders all went to AdamW, and the run trained
        # on without a word. Every rank holds the same model, so every rank raises this.
        shapes = ", ".join(f"{tuple(p.shape)}" for p in list(specs)[:4])
        raise ValueError(f"optimizer='muon' (--optimizer muon) found no parameter to step with Muon: none of the "
                         f"{len(specs)} parameters is a 2-D matrix that is not an embedding or output layer "
                         f"(shapes {shapes}{', ...' if len(specs) > 4 else ''}). Pass the model with its layers' "
                         f"full shapes (not flattened), or use optimizer='adam'")
    return specs


def orthogonalize(u: torch.Tensor, spec: MatrixSpec, config) -> torch.Tensor:
    """The orthogonalized update of a whole parameter: `u` (any shape of spec's numel) in, a flat bfloat16 tensor
    out, each block of spec Newton-Schulz'ed as its own matrix (unscaled: the update multiplies each block by its
    scale, MatrixSpec.scales)."""
    flat = u.reshape(-1)
    if flat.numel() != spec.rows * spec.cols:
        raise ValueError(f"orthogonalize: {flat.numel()} elements for a {spec.rows} x {spec.cols} matrix")
    pieces = [newton_schulz(flat[a:b].view(r, spec.cols), config.muon_num_ns_steps, config.muon_coefficient_type)
              for a, b, r in spec.blocks]
    return pieces[0].reshape(-1) if len(pieces) == 1 else torch.cat([p.reshape(-1) for p in pieces])


# ---------------------------------------------------------------------------------------------- the optimizer
MUON_GROUP_KEYS = ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_scale_mode", "muon_coefficient_type",
                   "muon_num_ns_steps", "muon_extra_scale_factor")


def muon_hyperparameters(config) -> Dict[str, object]:
    """The OptimizerConfig's muon_* values a Muon param group carries (and a resume checks)."""
    return {key: getattr(config, key) for key in MUON_GROUP_KEYS}


class MuonWithAdamW(torch.optim.Optimizer):
    """The inner optimizer of optimizer='muon': Muon steps the param groups with 'use_muon' True, torch.optim.AdamW
    the others (the same group dicts and state: `state[main]` is 'momentum_buffer' for a Muon tensor, as
    torch.optim.Muon keeps it, AdamW's 'step', 'exp_avg', 'exp_avg_sq' for the rest).

    A Muon tensor is a whole matrix or a flat piece of one (the distributed optimizer's shard): `matrices[main]`
    = (MatrixSpec, start, end), set by the MegatronOptimizer that owns it. The step comes in two stages around the
    orthogonalization, which may need other ranks' pieces of a matrix (MegatronOptimizer._orthogonalize)::

        updates = inner.momentum_updates()     {main: u}: lerp'ed momentum, out of place (no state changed)
        O = orthogonalize(updates)             {main: O piece}, flat, per matrix block
        inner.step(O)                          under the update lock: the momentum buffers, p *= 1 - lr * wd,
                                               p -= lr * scale * extra * O per block; AdamW's step

    Args:
        param_groups: dicts with 'params' (main tensors), 'weight_decay', 'use_muon'; Muon groups get the
            config's muon_* values (muon_hyperparameters).
        lr, weight_decay: defaults of a group that lacks them.
        config: the OptimizerConfig (muon_* and adam_* fields).
        adam_kernel: AdamW's kernel option ({'foreach': True}, {'fused': True}).
    """

    def __init__(self, param_groups, lr: float, weight_decay: float, config, **adam_kernel):
        groups = [dict(g) for g in param_groups]
        for group in groups:
            group.setdefault("use_muon", False)
            if group["use_muon"]:
                for key, value in muon_hyperparameters(config).items():
                    group.setdefault(key, value)
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw = None
        if adam_groups:  # the same dicts (AdamW fills in its defaults), the same state
            self._adamw = torch.optim.AdamW(adam_groups, lr=lr, weight_decay=weight_decay,
                                            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                            **adam_kernel)
            self._adamw.state = self.state
        self.matrices: Dict[torch.Tensor, Tuple[MatrixSpec, int, int]] = {}
        self._pending: Optional[Dict[torch.Tensor, torch.Tensor]] = None

    @torch.no_grad()
    def momentum_updates(self) -> Dict[torch.Tensor, torch.Tensor]:
        """Stage 1: {main: u} for every Muon tensor with a gradient, u = lerp(grad, buf', momentum) with Nesterov
        else buf', where buf' = lerp(buf, grad, 1 - momentum) (buf: zeros before the first step). Nothing is
        changed: step() stores buf'."""
        self._pending, updates = {}, {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            momentum = group["muon_momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = buf.lerp(grad, 1 - momentum)
                self._pending[p] = buf
                updates[p] = grad.lerp(buf, momentum) if group["muon_nesterov"] else buf
        return updates

    @torch.no_grad()
    def step(self, orthogonalized: Optional[Dict[torch.Tensor, torch.Tensor]] = None, closure=None):
        """Stage 3: `orthogonalized` = {main: its flat O piece} for every tensor momentum_updates() returned."""
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure (MegatronOptimizer.step computes the gradients)")
        pending, self._pending = self._pending or {}, None
        missing = [p for p in pending if orthogonalized is None or p not in orthogonalized]
        if missing or (orthogonalized and pending.keys() != orthogonalized.keys()):
            raise RuntimeError("MuonWithAdamW.step(orthogonalized) needs the orthogonalized update of exactly the "
                               "tensors momentum_updates() returned (MegatronOptimizer.step does both)")
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            lr, weight_decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p not in pending:
                    continue
                self.state[p]["momentum_buffer"] = pending[p]
                p.mul_(1 - lr * weight_decay)  # torch.optim.Muon's decoupled decay (Megatron: p -= lr * wd * p)
                spec, start, end = self.matrices[p]
                scales, update = spec.scales(group), orthogonalized[p].reshape(-1)
                if len(scales) == 1 and start == 0 and end == spec.rows * spec.cols:
                    p.add_(update.view_as(p), alpha=-(lr * scales[0]))  # torch.optim.Muon's own call
                    continue
                flat = p.view(-1)
                for (a, b, _), scale in zip(spec.blocks, scales):
                    lo, hi = max(a, start), min(b, end)
                    if lo < hi:
                        flat[lo - start:hi - start].add_(update[lo - start:hi - start], alpha=-(lr * scale))
        if self._adamw is not None:
            self._adamw.step()
