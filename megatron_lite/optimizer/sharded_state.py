"""A rank's optimizer state described as shards of named flat parameters: what the checkpoint formats, last
words and the replica transfer are all built on (megatron-core's `sharded_state_dict`, torchtitan's Stateful
components: the optimizer describes its own state, the formats only lay it out).

::

    parameter "h.0.weight", shape (4, 6): 24 elements, flattened
        | 0 ........................ 10 | 10 ............................... 24 |
          rank 0: ParamShard(start=0, end=10)  rank 1: ParamShard(start=10, end=24)
          tensors {'param', 'exp_avg', 'exp_avg_sq'}: 1-D fp32 views of the shard's main values and moments

A shard is a rank's range [start, end) of one parameter, flattened (the full-parameter optimizers hold every
parameter whole: one shard [0, numel)). MegatronOptimizer.sharded_state() returns a ShardedOptimizerState
(local: no collective; views, no copies) and load_sharded_state() takes one for the rank's current layout.
"""

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch


@dataclass(frozen=True)
class ParamShard:
    """One rank's range of one parameter: its main values and optimizer state."""

    name: str
    """The parameter's qualified name (MegatronOptimizer.param_to_name)."""
    start: int
    """First element of the shard in the flattened parameter."""
    end: int
    """One past the shard's last element."""
    shape: torch.Size
    """The whole parameter's shape."""
    tensors: Dict[str, torch.Tensor]
    """'param' (the fp32 main values) and the optimizer's state (ShardedOptimizerState.state_keys), 1-D,
    end - start elements each: its moments, and its per-parameter scalars (NAdam's mu_product) repeated. In
    a description taken from an optimizer the moments are views of its state (copy before keeping them).
    The moments are absent before the optimizer's first step; zeros (torch's initial state) for a parameter
    that skipped every step so far while the others stepped."""
    step: Optional[int] = None
    """The shard's own step count where the inner optimizer keeps one per tensor (torch's Adam), which lags
    the optimizer's for a parameter that skipped steps; None: the optimizer's (ShardedOptimizerState.step)."""
    model_data: Optional[torch.Tensor] = None
    """ZeRO-3 only: the model's own copy of the shard (the parameter's dtype), a view into the model's
    storage, so writing it sets the model's parameter shard. None where the model keeps whole parameters."""
    state_keys: Optional[Tuple[str, ...]] = None
    """The optimizer state this shard can carry, where its optimizer keeps different state for different
    parameters (optimizer='muon': 'momentum_buffer' for a Muon matrix, AdamW's moments for the rest); None:
    all of ShardedOptimizerState.state_keys (ShardedOptimizerState.keys_of)."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardedOptimizerState:
    """A rank's optimizer state: the part every rank shares and the rank's shards."""

    common: dict
    """What every rank shares (MegatronOptimizer.common_state_dict): 'optimizer' (the kind), 'param_groups'
    (hyperparameters) and 'grad_scaler'; loaded by load_common_state_dict."""
    step: int
    """The optimizer's step count: inner updates taken (overflow skips excluded), the same on every rank."""
    shards: Tuple[ParamShard, ...]
    """The rank's shards, in the optimizer's order."""
    params_sharded: bool = False
    """Whether the model, too, keeps only these shards of its parameters (ZeRO-3; see ParamShard.model_data)."""
    state_keys: Tuple[str, ...] = ()
    """The names of the optimizer's state each shard carries besides 'param' (elementwise.OptimizerKind,
    found by probing the optimizer class): moments, then per-parameter scalars."""
    scalar_keys: Tuple[str, ...] = ()
    """Those of state_keys that are one value per parameter, carried as a tensor of the shard's numel."""

    def keys_of(self, shard: ParamShard) -> Tuple[str, ...]:
        """The state keys `shard` can carry besides 'param' (ParamShard.state_keys): what every format writes
        and reads for it, no more."""
        return self.state_keys if shard.state_keys is None else shard.state_keys

    def own_step(self, shard: ParamShard) -> int:
        """The step count of `shard`: its own, else the optimizer's."""
        return self.step if shard.step is None else shard.step

    def lagging_steps(self) -> Dict[str, int]:
        """The shards' own step counts that differ from the optimizer's, by parameter name (what a checkpoint
        stores next to the one step count)."""
        return {s.name: s.step for s in self.shards if s.step is not None and s.step != self.step}

    def with_values(self, values: Dict[Tuple[str, int], Dict[str, torch.Tensor]], step: int,
                    lagging: Optional[Dict[str, int]] = None) -> "ShardedOptimizerState":
        """This layout with the tensors read from a checkpoint: `values[(name, start)]` = {'param', moments...}
        (flat, or any shape of the shard's numel), the optimizer's step count `step` and the shards' own
        counts `lagging` by name (the others are at `step`)."""
        lagging = lagging or {}
        shards = tuple(replace(s, tensors=dict(values[(s.name, s.start)]), step=lagging.get(s.name))
                       for s in self.shards)
        return replace(self, step=step, shards=shards)

    def params_only(self) -> "ShardedOptimizerState":
        """The main values alone, at step 0: what loading the parameters into a fresh optimizer takes."""
        shards = tuple(replace(s, tensors={"param": s.tensors["param"]}, step=None) for s in self.shards)
        return replace(self, step=0, shards=shards)


# ---------------------------------------------------------------------- the replica transfer's wire format
def flatten(state: ShardedOptimizerState, device) -> torch.Tensor:
    """[step, each shard's own step, every shard's 'param', then each moment of every shard that carries it
    (keys_of)] as one fp32 tensor of flat_numel(state) elements (moments never created yet travel as zeros)."""
    steps = [float(state.step)] + [float(state.own_step(s)) for s in state.shards]
    parts = [torch.tensor(steps, device=device)]
    parts += [s.tensors["param"] for s in state.shards]
    for key in state.state_keys:
        parts += [s.tensors[key] if key in s.tensors else torch.zeros_like(s.tensors["param"]) for s in state.shards
                  if key in state.keys_of(s)]
    return torch.cat([p.to(device=device, dtype=torch.float32) for p in parts])  # host state: offloaded


def flat_numel(state: ShardedOptimizerState) -> int:
    """The number of elements flatten(state) has (known from the layout alone)."""
    return 1 + len(state.shards) + sum((1 + len(state.keys_of(s))) * s.numel for s in state.shards)


def unflatten(flat: torch.Tensor, like: ShardedOptimizerState) -> ShardedOptimizerState:
    """The inverse of flatten: `like`'s layout with the values, steps and moments held by `flat` (views)."""
    if flat.numel() != flat_numel(like):
        raise ValueError(f"a flattened optimizer state of {flat.numel()} elements does not fit this layout "
                         f"({flat_numel(like)}): the buckets were cut differently (bucket size, data-parallel size)")
    own_steps = flat[1:1 + len(like.shards)].tolist()
    offset, tensors = 1 + len(like.shards), [{} for _ in like.shards]
    for key in ("param", *like.state_keys):
        for i, s in enumerate(like.shards):
            if key != "param" and key not in like.keys_of(s):
                continue
            tensors[i][key] = flat[offset:offset + s.numel]
            offset += s.numel
    shards = tuple(replace(s, tensors=tensors[i], step=int(own_steps[i])) for i, s in enumerate(like.shards))
    return replace(like, step=int(flat[0].item()), shards=shards)
