"""The state half of MegatronOptimizer: how an optimizer describes its state, saves it and restores it.

Described once, by sharded_state(): the rank's shards of named flat parameters (sharded_state.py); every
format is built on it. The state dict (the 'torch' format) is keyed by parameter *name* and holds full,
unpadded fp32 tensors, so it does not depend on the data-parallel size, the bucket layout or which of the
three optimizers wrote it. On resume the hyperparameters saved with the state meet this run's
(pick_hyperparameter), and the step counts are agreed across ranks (agreed_param_steps, agreed_step).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology
from .sharded_state import STATE_KEYS, ParamShard, ShardedOptimizerState

# Kernel choices are the loading machine's business (e.g. foreach on CPU, fused on CUDA), not the checkpoint's.
_NOT_SAVED_GROUP_KEYS = {"params", "foreach", "fused", "capturable", "differentiable"}

# Param-group hyperparameters checked against a checkpoint's on resume (lr belongs to the scheduler).
HYPERPARAMETER_KEYS = {"adam": ("weight_decay", "betas", "eps"), "sgd": ("weight_decay", "momentum")}


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


class OptimizerStateMixin:
    """Mixin of MegatronOptimizer (optimizer.py): its state, described and restored.

    Reads the optimizer's `optimizer` (the inner torch optimizer), `config`, `param_to_name`, `update_count`,
    `grad_scaler`, `device`, the data-parallel and expert groups; the subclasses say where their shards are
    (`_main_shards`), how the 'torch' format gathers them (`_gathered`), and write loaded main params into
    the model (`_copy_main_params_to_model_params`).
    """

    def _main_shards(self) -> List[Tuple[torch.nn.Parameter, int, int, torch.Tensor, Optional[torch.Tensor]]]:
        """(model param, start, end, main tensor, model data or None) of every shard this rank steps."""
        raise NotImplementedError

    @property
    def data_parallel_topology(self) -> DataParallelTopology:
        """Who holds which shard: the distributed optimizer's instances; for the full-parameter optimizers
        every rank a whole copy, i.e. one position held by every rank."""
        world = dist.get_world_size(self.data_parallel_group)
        return DataParallelTopology(world, world)

    def sharded_state(self) -> ShardedOptimizerState:
        """This rank's optimizer state as shards of named flat parameters (megatron-core's sharded_state_dict;
        views of the live state, not copies). Local: no collective."""
        shards = []
        for param, start, end, main, model_data in self._main_shards():
            state = self._state_of(main)
            if "step" in state:
                own_step = int(state["step"].item())
            else:  # Adam without state after updates: a parameter that skipped every step (torch's count: 0)
                skipped_all = self.config.optimizer == "adam" and self.update_count and not state
                own_step = 0 if skipped_all else None
            shards.append(ParamShard(self.param_to_name[param], start, end, param.shape, self._shard_tensors(main),
                                     own_step, model_data))
        return ShardedOptimizerState(self.common_state_dict(), self.update_count, tuple(shards), self.params_sharded)

    def _shard_tensors(self, main: torch.Tensor) -> Dict[str, torch.Tensor]:
        """A main tensor flattened as 'param', with its optimizer-state tensors (see ParamShard.tensors)."""
        state = self._state_of(main)
        flat = main.detach().reshape(-1)
        if not state and self.update_count:
            return {"param": flat, **{k: torch.zeros_like(flat) for k in STATE_KEYS[self.config.optimizer]}}
        return {"param": flat, **{k: state[k].reshape(-1) for k in STATE_KEYS[self.config.optimizer] if k in state}}

    @torch.no_grad()
    def load_sharded_state(self, state: ShardedOptimizerState, adopt: bool = False):
        """Set this rank's main params, moments and step counts from `state` (a description of this rank's
        layout: its shards are matched by (name, start)), then write the params into the model (for the
        distributed optimizer a collective: the parameter all-gather). The common part is loaded by
        load_common_state_dict(state.common, ...), first: it checks the kind and the hyperparameters.
        With `adopt` the moments become the optimizer's state as they are where they are fp32 on its device
        (no copy): for a caller that hands over tensors it read for this and keeps no other use of (the
        torch_dist load: a second copy of the moments would be the load's peak)."""
        self._load_shards(state, adopt)
        self._copy_main_params_to_model_params()

    def _load_shards(self, state: ShardedOptimizerState, adopt: bool = False):
        """load_sharded_state's local part: the main params, moments and step counts (no collective)."""
        given = {(s.name, s.start): s for s in state.shards}
        for param, start, _, main, _ in self._main_shards():
            shard = given[(self.param_to_name[param], start)]
            main.data.copy_(shard.tensors["param"].view_as(main))
            moments = {k: shard.tensors[k].view_as(main) for k in state.state_keys if k in shard.tensors}
            self._set_state_of(main, state.own_step(shard), moments, adopt)
        self.update_count = state.step

    # ------------------------------------------------------------------ the 'torch' format's state dict
    @torch.no_grad()
    def state_dict(self):
        """DP-size- and layout-independent state: hyperparameters, per-name fp32 tensors, loss scaler.
        Collective for the distributed optimizer (its shards are gathered)."""
        return {**self.common_state_dict(), "state": self._gathered(self.sharded_state())}

    def _gathered(self, state: ShardedOptimizerState) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: whole fp32 'param' and optimizer-state tensors (CPU copies), plus 'step'."""
        raise NotImplementedError

    def common_state_dict(self) -> dict:
        """What every rank shares: kind, param-group hyperparameters, loss scaler (no tensors of params)."""
        groups = [{k: v for k, v in g.items() if k not in _NOT_SAVED_GROUP_KEYS} for g in self.optimizer.param_groups]
        return {"optimizer": self.config.optimizer, "param_groups": groups,
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state_dict, hyperparameters: str = "check"):
        """Restore the state; the hyperparameters stored with it meet this run's per `hyperparameters`
        ('check', 'override' or 'checkpoint', see pick_hyperparameter). The learning rate is the
        scheduler's business."""
        missing = set(self.param_to_name.values()) - set(state_dict["state"])
        if missing:
            raise ValueError(f"optimizer checkpoint lacks parameters: {sorted(missing)[:10]}")
        self.load_common_state_dict(state_dict, hyperparameters)
        self.load_sharded_state(self._shards_of(state_dict["state"]))

    def _shards_of(self, full: Dict[str, Dict[str, torch.Tensor]]) -> ShardedOptimizerState:
        """This rank's shards cut out of whole per-name tensors (a 'torch' checkpoint's state)."""
        layout, values = self.sharded_state(), {}
        for shard in layout.shards:
            entry = full[shard.name]
            if tuple(entry["param"].shape) != tuple(shard.shape):
                raise ValueError(f"shape mismatch for {shard.name}: checkpoint {tuple(entry['param'].shape)}, "
                                 f"model {tuple(shard.shape)}")
            values[(shard.name, shard.start)] = {k: entry[k].reshape(-1)[shard.start:shard.end]
                                                 for k in ("param", *layout.state_keys) if k in entry}
        own = {shard.name: full[shard.name].get("step") for shard in layout.shards}
        step = max([int(e.get("step", 0)) for e in full.values()] + [0])
        return layout.with_values(values, step, {n: s for n, s in own.items() if s is not None})

    def load_common_state_dict(self, state_dict, hyperparameters: str = "check"):
        """The kind check, group-level state with its hyperparameters (see load_state_dict), loss scaler."""
        if state_dict.get("optimizer") != self.config.optimizer:
            raise ValueError(f"checkpoint was written by optimizer {state_dict.get('optimizer')!r}, this is "
                             f"{self.config.optimizer!r}")
        # Group-level state (apex keeps Adam's step per group) and the hyperparameters stored with it.
        saved_groups = {(g.get("wd_mult"), g.get("lr_mult")): g for g in state_dict["param_groups"]}
        for group in self.optimizer.param_groups:
            saved = saved_groups.get((group.get("wd_mult"), group.get("lr_mult")))
            if saved is None:
                continue
            if "step" in saved:
                group["step"] = saved["step"]
            for key in HYPERPARAMETER_KEYS[self.config.optimizer]:
                if key in saved and key in group:
                    current = tuple(group[key]) if isinstance(group[key], (list, tuple)) else group[key]
                    value = tuple(saved[key]) if isinstance(saved[key], (list, tuple)) else saved[key]
                    group[key] = pick_hyperparameter(f"optimizer {key} (wd_mult {group.get('wd_mult')})",
                                                     current, value, hyperparameters)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _state_of(self, main_param: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self.optimizer.state.get(main_param, {})

    def agreed_param_steps(self) -> Dict[str, int]:
        """Every parameter's own step count (ShardedOptimizerState.own_step), on every rank: the largest over
        the ranks holding a shard of it (one all-reduce). Collective."""
        state, mine, agreed = self.sharded_state(), {}, {}
        for shard in state.shards:
            mine[shard.name] = state.own_step(shard)
        # Expert parameters over their expert group only: other groups hold (and may name) other experts.
        for expert, group in ((False, self.data_parallel_group), (True, self.expert_data_parallel_group)):
            names = [name for p, name in self.param_to_name.items() if (p in self.expert_params) == expert]
            if expert and not names:
                continue
            steps = torch.tensor([mine.get(name, 0) for name in names], dtype=torch.int64, device=self.device)
            collectives.all_reduce(steps, group, op=collectives.MAX)
            agreed.update(zip(names, steps.tolist()))
        return agreed

    def agreed_lagging_steps(self) -> Dict[str, int]:
        """The entries of agreed_param_steps() that differ from the optimizer's step count. Collective."""
        return {name: s for name, s in self.agreed_param_steps().items() if s != self.update_count}

    def agreed_step(self) -> int:
        """The optimizer's step count, the largest over the data-parallel ranks. Collective."""
        step = torch.tensor(self.update_count, device=self.device)
        collectives.all_reduce(step, self.data_parallel_group, op=collectives.MAX)
        return int(step.item())

    def _set_state_of(self, main_param: torch.Tensor, step, tensors: Dict[str, torch.Tensor], adopt: bool = False):
        if not tensors:
            return
        state = self.optimizer.state[main_param]
        for key, value in tensors.items():
            moved = value.to(device=main_param.device, dtype=torch.float32)
            state[key] = moved if adopt or moved is not value else moved.clone()  # never the caller's tensor unasked
        if step is not None and self.config.optimizer == "adam":
            # torch keeps Adam's step on the CPU, except for its fused/capturable kernels.
            on_device = self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=main_param.device if on_device else "cpu")
