"""Which torch.optim class steps the main shards, and what state it keeps: found by a probe, not a table.

The distributed optimizer hands its inner optimizer flat ranges that cut parameters anywhere, one range per
rank, so only an *elementwise* optimizer can step them: one whose update of an element depends on that
element's value, gradient and state alone (Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, ...).
probe() tells, for any class and hyperparameters, by stepping a small parameter two ways::

    whole   (4, 6) parameter, one optimizer           3 steps with gradients g1, g2, g3
    pieces  flat [0:7] and [7:24], one optimizer each  the same gradients, cut the same way
    elementwise  <=>  the pieces' values and state, put back together, equal the whole's

and what the whole's state holds, per key: tensors shaped like the parameter (moments: cut with it),
0-dim tensors ('step', NAdam's 'mu_product': one value per parameter), nothing else. A class that fails
(a normalized update, matrix work such as torch.optim.Muon's, state of another shape) is refused with a
ValueError. The result, an OptimizerKind, is what ShardState, the checkpoint formats, last words and the
replica transfer read (sharded_state.py).
"""

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .muon import MuonWithAdamW, muon_hyperparameters

# Hyperparameters that say how to compute, not what: never checked against a checkpoint's.
KERNEL_KEYS = ("foreach", "fused", "capturable", "differentiable")

# State torch.optim's elementwise classes keep as running sums, averages or maxima of squares or magnitudes
# (Adam's second moments, RMSprop's and Adadelta's square averages, Adagrad's sum, Adamax's infinity norm): never
# negative, so a negative value marks a damaged copy (MegatronOptimizer.recv_shard_state refuses it).
NONNEGATIVE_STATE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf")

# Megatron's --optimizer choices and the torch.optim class each builds (config -> constructor kwargs).
NAMED = {
    "adam": (torch.optim.AdamW, lambda c: {"betas": (c.adam_beta1, c.adam_beta2), "eps": c.adam_eps}),
    "sgd": (torch.optim.SGD, lambda c: {"momentum": c.sgd_momentum}),
}


@dataclass(frozen=True)
class OptimizerKind:
    """An elementwise optimizer class with its hyperparameters, and the state it keeps per parameter."""

    name: str
    """'adam' or 'sgd' (OptimizerConfig.optimizer), else the class's qualified name: what a checkpoint
    records and a resume must match."""
    cls: type
    """The torch.optim class."""
    kwargs: Tuple[Tuple[str, object], ...]
    """Its hyperparameters besides lr and weight_decay, as sorted (key, value) pairs."""
    tensor_keys: Tuple[str, ...]
    """State shaped like the parameter (moments): sharded with it."""
    scalar_keys: Tuple[str, ...]
    """0-dim state other than 'step', one value per parameter (NAdam's 'mu_product')."""
    keeps_step: bool
    """Whether it keeps a per-parameter 'step' tensor (Adam and most others; SGD does not)."""
    initial_state: Optional[Dict[str, float]]
    """None: state is made by the first step (lazily). Else the constant values the constructor fills each
    key with (Adagrad's 'step' 0 and 'sum' initial_accumulator_value)."""
    hyperparameter_keys: Tuple[str, ...]
    """Param-group keys checked against a checkpoint's on resume (all its defaults but lr and kernels)."""
    group_kinds: Optional[Tuple[Tuple[str, "OptimizerKind"], ...]] = None
    """An optimizer whose param groups keep different state (optimizer='muon': Muon's matrices a
    'momentum_buffer', AdamW's rest its moments and step): (name, kind) of each part, a group's part named by
    its 'use_muon' key (of_group). None: every group is this kind. The fields above are then the parts'
    union, what a description may carry at most."""

    def of_group(self, group: dict) -> "OptimizerKind":
        """The kind that steps param group `group` (see group_kinds)."""
        if self.group_kinds is None:
            return self
        return dict(self.group_kinds)["muon" if group.get("use_muon") else "adam"]

    @property
    def nonnegative_keys(self) -> Tuple[str, ...]:
        """The moments that cannot be negative (NONNEGATIVE_STATE, for torch.optim's own classes only: another
        class may give the same name to a signed quantity); for optimizer='muon', its AdamW part's."""
        if self.group_kinds is not None:
            return tuple(dict.fromkeys(k for _, part in self.group_kinds for k in part.nonnegative_keys))
        if not self.cls.__module__.startswith("torch.optim."):
            return ()
        return tuple(k for k in self.tensor_keys if k in NONNEGATIVE_STATE)

    @property
    def state_keys(self) -> Tuple[str, ...]:
        """What a description carries per shard besides 'param': the moments, then the scalars (each as a
        tensor of the shard's numel, filled with the parameter's value, so every format carries it as it
        carries a moment)."""
        return self.tensor_keys + self.scalar_keys


def optimizer_kind(config) -> OptimizerKind:
    """The kind an OptimizerConfig builds: its optimizer_class (+ optimizer_kwargs) or its named optimizer.
    Raises ValueError (TypeError for a non-class) when the class cannot step flat shards."""
    if config.optimizer == "muon":
        return _muon_kind(tuple(sorted(muon_hyperparameters(config).items())), config.adam_beta1, config.adam_beta2,
                          config.adam_eps, config.weight_decay)
    if config.optimizer_class is None:
        cls, kwargs_of = NAMED[config.optimizer]
        name, kwargs = config.optimizer, kwargs_of(config)
    else:
        cls, kwargs = config.optimizer_class, dict(config.optimizer_kwargs or {})
        name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
    try:
        frozen = tuple(sorted(kwargs.items()))
        hash(frozen)
    except TypeError:  # e.g. a list value: probe uncached
        return _probe(name, cls, tuple(sorted(kwargs.items())), config.weight_decay)
    return _probe_cached(name, cls, frozen, config.weight_decay)


@functools.lru_cache(maxsize=64)
def _probe_cached(name, cls, kwargs, weight_decay) -> OptimizerKind:
    return _probe(name, cls, kwargs, weight_decay)


def _probe(name, cls, kwargs, weight_decay) -> OptimizerKind:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"OptimizerConfig.optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                        f"torch.optim.NAdam), got {cls!r}")
    for key in ("params", "lr", "weight_decay"):
        if key in dict(kwargs):
            raise ValueError(f"OptimizerConfig.optimizer_kwargs must not hold {key!r}: "
                             + ("the parameters are the optimizer's" if key == "params" else
                                f"set OptimizerConfig.{key} (the scheduler and the weight-decay groups use it)"))
    refuse = functools.partial(_refusal, name)
    kw = dict(kwargs)
    # Kernel options say how to compute, not what, and some need an accelerator (capturable: CUDA tensors): the
    # class must take them, but the probe steps torch's default kernel on the CPU.
    math_kw = {k: v for k, v in kw.items() if k not in KERNEL_KEYS}
    whole = torch.nn.Parameter(torch.linspace(-1.0, 1.5, 24).reshape(4, 6))
    pieces = [torch.nn.Parameter(whole.detach().reshape(-1)[a:b].clone()) for a, b in ((0, 7), (7, 24))]
    try:
        cls([{"params": [whole], "weight_decay": weight_decay}], lr=1e-2, **kw)
        optimizers = [cls([{"params": [whole], "weight_decay": weight_decay}], lr=1e-2, **math_kw)]
    except Exception as error:  # noqa: BLE001 - any failure to build is the user's class or kwargs
        raise ValueError(f"OptimizerConfig.optimizer_class {name} cannot be built with optimizer_kwargs "
                         f"{kw}: {type(error).__name__}: {error}") from error
    try:
        optimizers += [cls([{"params": [p], "weight_decay": weight_decay}], lr=1e-2, **math_kw) for p in pieces]
    except Exception as error:  # noqa: BLE001 - e.g. Muon, which takes matrices only
        raise refuse(f"it cannot be built on a flat piece of a parameter ({type(error).__name__}: {error})") from error
    if weight_decay and "weight_decay" not in optimizers[0].defaults:
        raise ValueError(f"OptimizerConfig.optimizer_class {name} takes no weight_decay, but "
                         f"OptimizerConfig.weight_decay is {weight_decay}: set weight_decay=0.0")
    initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizers[0].state.get(whole, {}).items()}
    generator = torch.Generator().manual_seed(1234)
    try:
        for _ in range(3):
            grad = torch.randn(4, 6, generator=generator)
            whole.grad = grad.clone()
            pieces[0].grad, pieces[1].grad = grad.reshape(-1)[:7].clone(), grad.reshape(-1)[7:].clone()
            for optimizer in optimizers:
                optimizer.step()
    except Exception as error:  # noqa: BLE001 - e.g. Muon on a 1-D piece
        raise refuse(f"stepping a flat piece of a parameter failed ({type(error).__name__}: {error})") from error
    if not _same(whole.detach().reshape(-1), torch.cat([p.detach() for p in pieces])):
        raise refuse("flat pieces of a parameter stepped apart end up with other values than the whole "
                     "parameter stepped at once (its update is not elementwise)")
    state, piece_states = optimizers[0].state[whole], [o.state[p] for o, p in zip(optimizers[1:], pieces)]
    tensor_keys, scalar_keys = [], []
    for key, value in state.items():
        if not torch.is_tensor(value) or not all(key in s for s in piece_states):
            raise refuse(f"its state {key!r} is {type(value).__name__}, not a tensor kept for every piece")
        if value.shape == whole.shape:
            together = torch.cat([s[key].reshape(-1) for s in piece_states])
            if not _same(value.reshape(-1), together):
                raise refuse(f"its state {key!r} differs between the whole parameter and its pieces")
            tensor_keys.append(key)
        elif value.dim() == 0:
            if not all(_same(value, s[key]) for s in piece_states):
                raise refuse(f"its per-parameter value {key!r} differs between the whole parameter and its pieces")
            if key != "step":
                scalar_keys.append(key)
        else:
            raise refuse(f"its state {key!r} has shape {tuple(value.shape)}, neither the parameter's nor a scalar")
    initial_state = None
    if initial:
        if not all(torch.is_tensor(v) and v.numel() and bool((v == v.reshape(-1)[0]).all()) for v in initial.values()):
            raise refuse("its constructor fills the state with values that are not one constant per key")
        initial_state = {k: float(v.reshape(-1)[0]) for k, v in initial.items()}
    hyper = tuple(k for k in sorted(optimizers[0].defaults) if k not in KERNEL_KEYS and k != "lr")
    return OptimizerKind(name, cls, tuple(kwargs), tuple(tensor_keys), tuple(scalar_keys), "step" in state,
                         initial_state, hyper)


def state_changes(kind: OptimizerKind, taken: Dict[str, object]) -> Tuple[str, ...]:
    """The state keys that the class of `kind` (an elementwise part, probed) keeps, or not, once the group
    hyperparameters `taken` replace its own (a resume taking a checkpoint's: RMSprop's centered, Adam's amsgrad):
    () when the state is the same, as for most values (a beta, eps, weight_decay)."""
    if kind.group_kinds is not None or kind.name == "muon" or not set(taken) - {"weight_decay"}:
        return ()
    kwargs = {**dict(kind.kwargs), **{k: v for k, v in taken.items() if k != "weight_decay"}}
    other = _probe(kind.name, kind.cls, tuple(sorted(kwargs.items())), taken.get("weight_decay", 0.0))
    if (other.scalar_keys, other.keeps_step, other.initial_state) != (kind.scalar_keys, kind.keeps_step,
                                                                      kind.initial_state):
        return tuple(sorted(set(other.state_keys) ^ set(kind.state_keys))) or ("step",)
    return tuple(sorted(set(other.tensor_keys) ^ set(kind.tensor_keys)))


@functools.lru_cache(maxsize=16)
def _muon_kind(muon_kwargs, beta1, beta2, eps, weight_decay) -> OptimizerKind:
    """optimizer='muon': Muon's part (torch.optim.Muon's state: 'momentum_buffer' only, no step count) and the
    AdamW part (probed as 'adam' is), together (muon.MuonWithAdamW)."""
    adam = _probe_cached("adam", torch.optim.AdamW, (("betas", (beta1, beta2)), ("eps", eps)), weight_decay)
    muon = OptimizerKind("muon", MuonWithAdamW, muon_kwargs, ("momentum_buffer",), (), False, None,
                         tuple(sorted(("weight_decay", "use_muon", *dict(muon_kwargs)))))
    return OptimizerKind("muon", MuonWithAdamW, muon_kwargs + adam.kwargs, muon.tensor_keys + adam.tensor_keys,
                         adam.scalar_keys, adam.keeps_step, None,
                         tuple(sorted(set(muon.hyperparameter_keys) | set(adam.hyperparameter_keys))),
                         (("muon", muon), ("adam", adam)))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Vectorized and scalar loops may round a transcendental function differently in the last bit.
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-9)


def _refusal(name: str, why: str) -> ValueError:
    return ValueError(
        f"OptimizerConfig.optimizer_class {name} is not elementwise: {why}. The optimizers step flat shards "
        f"that cut parameters anywhere, which only an elementwise optimizer can (torch.optim's Adam, AdamW, "
        f"SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam); use one of those, or an optimizer whose update of "
        f"each element depends on that element's gradient and state alone")
