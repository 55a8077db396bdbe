"""The optimizer's state over its main shards: ShardState, which MegatronOptimizer's constructor builds and holds
(composition: the optimizer steps, ShardState describes and restores what the steps changed)::

    MegatronOptimizer (optimizer.py)                   ShardState (this file)
      main_shards, built by the subclass's constructor   main_shards: MainShard(param, start, end, main) each
      step(): the inner optimizer updates the mains      inner.state[main]: moments, Adam's own step count
      update_count (inner updates taken)                 the inner optimizer's param groups, the loss scaler
      sharded_state()       -> shard_state.describe(update_count)         local: views, no copies
      load_sharded_state()  -> shard_state.load(...), then the params into the model
      state_dict(), agreed_*_step(s), replicas' send/recv: the collectives, on the optimizer

Described once, by describe(): the rank's shards of named flat parameters (sharded_state.py); every format is
built on it. The state dict (the 'torch' format) is keyed by parameter *name* and holds full, unpadded fp32
tensors, so it does not depend on the data-parallel size, the bucket layout or which of the three optimizers
wrote it (cut_shards takes a rank's part of it back). On resume the hyperparameters saved with the state
meet this run's (pick_hyperparameter).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from .elementwise import KERNEL_KEYS, OptimizerKind, state_changes
from .sharded_state import ParamShard, ShardedOptimizerState

# Kernel choices are the loading machine's business (e.g. foreach on CPU, fused on CUDA), not the checkpoint's.
_NOT_SAVED_GROUP_KEYS = {"params", *KERNEL_KEYS}


def pick_hyperparameter(name: str, current, saved, policy: str = "check"):
    """Megatron's rule for a value that is both in this run and in the checkpoint it resumes: 'check' (the
    default) requires them equal, 'override' keeps this run's, 'checkpoint' takes the checkpoint's."""
    if policy not in ("check", "override", "checkpoint"):
        raise ValueError(f"hyperparameters must be 'check', 'override' or 'checkpoint', got {policy!r}")
    if policy == "override" or saved == current:
        return current
    if policy == "checkpoint":
        return saved
    raise ValueError(
        f"{name} is {current} in this run but {saved} in the checkpoint: resume with the same value, or pass "
        f"--override-opt_param-scheduler to keep this run's or --use-checkpoint-opt_param-scheduler to take "
        f"the checkpoint's (load_checkpoint(hyperparameters='override' / 'checkpoint'))"
    )


@dataclass(frozen=True, eq=False)
class MainShard:
    """One tensor the inner optimizer steps: the fp32 main values of the range [start, end) of a flattened
    model parameter (the full-parameter optimizers step every parameter whole: [0, numel))."""

    param: torch.nn.Parameter
    """The model parameter."""
    start: int
    """First element of the range in the flattened parameter."""
    end: int
    """One past the range's last element."""
    main: torch.nn.Parameter
    """The fp32 main values (main_params.py), end - start elements: what the inner optimizer's state is keyed by."""
    # eq=False: compared and hashed as the object it is (a dict key of MegatronOptimizer._orthogonalize), never
    # by its tensors' values.


def cut_shards(full: Dict[str, Dict[str, torch.Tensor]], layout: ShardedOptimizerState) -> ShardedOptimizerState:
    """`layout` (a rank's description) with its shards cut out of whole per-name tensors (a 'torch'
    checkpoint's state: name -> {'param', moments..., 'step'})."""
    values = {}
    for shard in layout.shards:
        entry = full[shard.name]
        if tuple(entry["param"].shape) != tuple(shard.shape):
            raise ValueError(f"shape mismatch for {shard.name}: checkpoint {tuple(entry['param'].shape)}, "
                             f"model {tuple(shard.shape)}")
        values[(shard.name, shard.start)] = {k: entry[k].reshape(-1)[shard.start:shard.end]
                                             for k in ("param", *layout.keys_of(shard)) if k in entry}
    own = {shard.name: full[shard.name].get("step") for shard in layout.shards}
    step = max([int(e.get("step", 0)) for e in full.values()] + [0])
    return layout.with_values(values, step, {n: s for n, s in own.items() if s is not None})


class ShardState:
    """A MegatronOptimizer's state: per main shard its values, moments and step count (the inner optimizer's
    state), and what every rank shares (kind, param-group hyperparameters, loss scaler). Described as a
    ShardedOptimizerState and restored from one; local: no collective.

    Args:
        inner: the inner torch optimizer, over the main shards' `main` tensors.
        kind: what the inner optimizer is and which state it keeps (elementwise.optimizer_kind).
        main_shards: what the inner optimizer steps, in the optimizer's order.
        param_to_name: model parameter -> qualified name (the name its shards are saved under).
        grad_scaler: the loss scaler (fp16) or None.
    """

    def __init__(self, inner: torch.optim.Optimizer, kind: OptimizerKind, main_shards: Sequence[MainShard],
                 param_to_name: Dict[torch.nn.Parameter, str], grad_scaler):
        self.inner = inner
        self.kind = kind
        self.main_shards = tuple(main_shards)
        self.param_to_name = param_to_name
        self.grad_scaler = grad_scaler
        # The kind that steps each main tensor: the same for all, except optimizer='muon' (OptimizerKind.of_group).
        self._kind_of = {id(p): kind.of_group(g) for g in inner.param_groups for p in g["params"]}
        self._group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        self._mixed = kind.group_kinds is not None

    def kind_of(self, main: torch.Tensor):
        """The OptimizerKind stepping `main` (its param group's part, OptimizerKind.of_group)."""
        return self._kind_of.get(id(main), self.kind)

    def describe(self, step: int, model_data: Optional[Sequence[torch.Tensor]] = None) -> ShardedOptimizerState:
        """The state as shards of named flat parameters (megatron-core's sharded_state_dict; views of the live
        state, not copies). `step`: the optimizer's count of inner updates; `model_data`: ZeRO-3 only, the
        model's own copy of each main shard (aligned with main_shards), else None."""
        shards = []
        for i, shard in enumerate(self.main_shards):
            state, kind = self.inner.state.get(shard.main, {}), self.kind_of(shard.main)
            if "step" in state:
                own_step = int(state["step"].item())
            else:  # no state after updates: a parameter that skipped every step (torch's count: 0). Recorded
                # for SGD too (no 'step'), whose first step starts its momentum from the gradient, not from zeros.
                lazy = (kind.keeps_step or kind.tensor_keys) and kind.initial_state is None
                skipped_all = lazy and step and not state
                own_step = 0 if skipped_all else None
            shards.append(ParamShard(self.param_to_name[shard.param], shard.start, shard.end, shard.param.shape,
                                     self._tensors(shard.main, step), own_step,
                                     None if model_data is None else model_data[i],
                                     kind.state_keys if self._mixed else None))
        return ShardedOptimizerState(self.common_state_dict(), step, tuple(shards), model_data is not None,
                                     self.kind.state_keys, self.kind.scalar_keys)

    def _tensors(self, main: torch.Tensor, step: int) -> Dict[str, torch.Tensor]:
        """A main tensor flattened as 'param', with its optimizer-state tensors (see ParamShard.tensors): the
        moments as views, each scalar (NAdam's mu_product) as the shard's numel copies of it."""
        state, kind = self.inner.state.get(main, {}), self.kind_of(main)
        flat = main.detach().reshape(-1)
        if not state and step:  # skipped every step: zeros stand for "no state yet" (load() drops them)
            return {"param": flat, **{k: torch.zeros_like(flat) for k in kind.state_keys}}
        tensors = {"param": flat, **{k: state[k].reshape(-1) for k in kind.tensor_keys if k in state}}
        for key in kind.scalar_keys:
            if key in state:
                tensors[key] = state[key].to(device=flat.device, dtype=torch.float32).expand(flat.numel()).clone()
        return tensors

    @torch.no_grad()
    def load(self, state: ShardedOptimizerState, adopt: bool = False):
        """Set the main values, moments and step counts from `state`, a description of this layout (its
        shards matched by (name, start)); the optimizer's own count is `state.step`. With `adopt` the moments
        become the inner optimizer's state as they are where they are fp32 on its device (see
        MegatronOptimizer.load_sharded_state)."""
        given = {(s.name, s.start): s for s in state.shards}
        for shard in self.main_shards:
            described = given[(self.param_to_name[shard.param], shard.start)]
            shard.main.data.copy_(described.tensors["param"].view_as(shard.main))
            kind = self.kind_of(shard.main)
            moments = {k: described.tensors[k].view_as(shard.main) for k in kind.tensor_keys
                       if k in described.tensors}
            scalars = {k: described.tensors[k].reshape(-1)[0] for k in kind.scalar_keys if k in described.tensors}
            step = state.own_step(described)
            if not (moments or scalars):
                continue
            if step == 0 and kind.initial_state is None:
                self.inner.state.pop(shard.main, None)  # never stepped: torch makes the state at the first step
            else:
                self._set_state_of(shard.main, step, moments, scalars, adopt)

    def forget_moments(self):
        """Return the inner optimizer's state of every main shard to what it was before the first step: none
        (made by the first step), or the constructor's constants (Adagrad's)."""
        for shard in self.main_shards:
            self.inner.state.pop(shard.main, None)
            kind = self.kind_of(shard.main)
            if kind.initial_state is not None:
                state = self.inner.state[shard.main]
                for key, value in kind.initial_state.items():
                    like = shard.main if key in kind.tensor_keys else torch.tensor(0.0)
                    state[key] = torch.full_like(like, value, dtype=torch.float32, memory_format=torch.preserve_format)

    def _set_state_of(self, main: torch.Tensor, step, tensors: Dict[str, torch.Tensor],
                      scalars: Dict[str, torch.Tensor], adopt: bool = False):
        state = self.inner.state[main]
        for key, value in tensors.items():
            moved = value.to(device=main.device, dtype=torch.float32)
            state[key] = moved if adopt or moved is not value else moved.clone()  # never the caller's tensor unasked
        # torch keeps the step and other per-parameter scalars on the CPU, except for fused/capturable kernels
        # (decided per param group, as torch.optim's load_state_dict does: optimizer='muon's AdamW groups).
        group = self._group_of.get(id(main), self.inner.defaults)
        on_device = group.get("fused") or group.get("capturable")
        where = main.device if on_device else "cpu"
        for key, value in scalars.items():
            state[key] = value.detach().to(device=where, dtype=torch.float32).clone().reshape(())
        if step is not None and self.kind_of(main).keeps_step:
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=where)

    # ------------------------------------------------------------------ what every rank shares
    def common_state_dict(self) -> dict:
        """Kind, param-group hyperparameters, loss scaler (no tensors of params)."""
        groups = [{k: v for k, v in g.items() if k not in _NOT_SAVED_GROUP_KEYS} for g in self.inner.param_groups]
        return {"optimizer": self.kind.name, "param_groups": groups,
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict()}

    def load_common_state_dict(self, state_dict, hyperparameters: str = "check"):
        """The kind check, group-level state with its hyperparameters (met per `hyperparameters`, see
        pick_hyperparameter), loss scaler."""
        if state_dict.get("optimizer") != self.kind.name:
            raise ValueError(f"checkpoint was written by optimizer {state_dict.get('optimizer')!r}, this is "
                             f"{self.kind.name!r}: build the one it was written with (OptimizerConfig.optimizer, "
                             f"--optimizer, or OptimizerConfig.optimizer_class, --optimizer-class), or load the "
                             f"model without the optimizer state (--no-load-optim, load_checkpoint(load_optim=False))")
        # Group-level state (apex keeps Adam's step per group) and the hyperparameters stored with it.
        # (optimizer='muon' has a Muon group and an AdamW group with the same multipliers: use_muon tells them.)
        saved_groups = {(g.get("wd_mult"), g.get("lr_mult"), g.get("use_muon")): g for g in state_dict["param_groups"]}
        for group in self.inner.param_groups:
            saved = saved_groups.get((group.get("wd_mult"), group.get("lr_mult"), group.get("use_muon")))
            if saved is None:
                continue
            if "step" in saved:
                group["step"] = saved["step"]
            taken = {}
            for key in self.kind.of_group(group).hyperparameter_keys:
                if key in saved and key in group:
                    current = tuple(group[key]) if isinstance(group[key], (list, tuple)) else group[key]
                    value = tuple(saved[key]) if isinstance(saved[key], (list, tuple)) else saved[key]
                    group[key] = pick_hyperparameter(f"optimizer {key} (wd_mult {group.get('wd_mult')})",
                                                     current, value, hyperparameters)
                    if group[key] != current:
                        taken[key] = group[key]
            changed = state_changes(self.kind.of_group(group), taken)
            if changed:  # the inner optimizer would step without (or beside) state its class then keeps
                raise ValueError(f"the checkpoint's optimizer hyperparameters {taken} change the state "
                                 f"{self.kind.name} keeps ({', '.join(changed)}): build the optimizer with them "
                                 f"(OptimizerConfig.optimizer_kwargs, --optimizer-kwargs) instead of taking them from "
                                 f"the checkpoint (hyperparameters='checkpoint', --use-checkpoint-opt_param-scheduler)")
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
