"""Megatron's optimizer protocol (MegatronOptimizer) and the helpers its implementations share: the
non-sharded ones in full_param_optimizer.py, the sharded one in distrib_optimizer.py.

    step():  main grads <- model main_grad      (alias for fp32; fp32 copy for fp16/bf16)
             collectives: fp16 inf/NaN check agreed by all ranks; global grad norm (and zero count)
             local update, under update_lock: loss scaler; unless overflow: clip -> inner optimizer step
             model params <- main params         (cast; the distributed optimizer then all-gathers)
             returns (update_successful, grad_norm, num_zeros_in_grad)

The state is described once, by sharded_state(): the rank's shards of named flat parameters
(sharded_state.py); every format is built on it. The state dict (the 'torch' format) is keyed by parameter
*name* and holds full, unpadded fp32 tensors, so it does not depend on the data-parallel size, the bucket
layout or which of the three optimizers wrote it.
"""

import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology
from .clip_grads import clip_grads_by_total_norm, count_zeros_fp32, get_grad_norm_fp32
from .cpu_offload import GradStaging, host_main_param, offload_plan
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optimizer_config import OptimizerConfig
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


class MegatronOptimizer:
    """Shared step() logic; subclasses decide what the main params are and how results reach the model.

    Args:
        optimizer: the inner torch optimizer, over the main params.
        config: the OptimizerConfig.
        model_chunks: the DistributedDataParallel-wrapped model chunks.
        grad_scaler: loss scaler (fp16 only) or None.
    The main params (what the inner optimizer steps) are built by `main_param` in every subclass: the
    model's fp32 data itself, or an fp32 copy of fp16/bf16 data; the distributed optimizer does this for
    the rank's shards only.
    """

    sharded = False  # whether each rank holds only a shard of the main params / grads
    params_sharded = False  # whether the model, too, keeps only the rank's shards of its parameters (ZeRO-3)

    def __init__(self, optimizer, config: OptimizerConfig, model_chunks, grad_scaler):
        self.optimizer = optimizer
        self.config = config
        self.model_chunks = model_chunks
        self.grad_scaler = grad_scaler
        self.data_parallel_group = model_chunks[0].data_parallel_group
        # Where each gradient element lives exactly once: the data-parallel group, or with several
        # distributed-optimizer instances this rank's instance (the others hold replicas of the same
        # shards, which must not be counted twice in the norm, the zero count or the overflow check).
        self.grad_stats_group = model_chunks[0].intra_instance_group
        # Expert parameters (allreduce = False): replicated only over their expert data-parallel group, each
        # group holding other experts. `has_expert_params` is the same on every rank (agreed at wrap time).
        self.expert_params = frozenset().union(*(getattr(c, "expert_params", ()) for c in model_chunks))
        topology = getattr(model_chunks[0], "expert_topology", None)
        self.has_expert_params = topology is not None and topology.has_expert_params
        self.expert_data_parallel_group = model_chunks[0].expert_data_parallel_group if self.has_expert_params \
            else None
        self._counts_expert_grads = self.has_expert_params and topology.expert_data_parallel_rank == 0
        self.param_to_name = qualified_param_names(model_chunks)
        self.device = next(iter(self.param_to_name)).device if self.param_to_name else torch.device("cpu")
        self._loss_scale = None  # (scale, tensor) cache for get_loss_scale
        self.update_lock = threading.Lock()  # held while step() changes the state (main params, moments)
        self.updating = False  # True inside the update; stays True if it raised half-way (a torn state)
        self.steps_taken = 0  # step() calls that got past their decision (an overflow skip included)
        self.update_count = 0  # inner optimizer steps taken (overflow skips excluded); set again by a load
        self.last_step_successful = True
        self._grad_staging = GradStaging()  # optimizer_cpu_offload: the host copies of the main grads

    # ------------------------------------------------------------------ protocol
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        # Called once per micro-batch: rebuild the (device) tensor only when the scale changed.
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        cached = self._loss_scale
        if cached is None or cached[0] != scale:
            self._loss_scale = cached = (scale, torch.tensor(scale, dtype=torch.float32, device=self.device))
        return cached[1]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale()

    def zero_grad(self, set_to_none: bool = True):
        """Drop the main params' gradients (always set to None; the DDP buffers are zeroed by
        zero_grad_buffer(), the argument exists for torch compatibility)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for p in self.param_to_name:
            p.grad = None

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        for chunk in self.model_chunks:
            chunk.check_ready_for_step()  # unreduced gradients would make the replicas diverge
        if any(g["lr"] is None for g in self.optimizer.param_groups):
            raise ValueError("OptimizerConfig.lr is None and no learning-rate scheduler set it: build an "
                             "OptimizerParamScheduler over this optimizer, or give OptimizerConfig an lr")
        self._prepare_for_step()
        main_grads = self._copy_model_grads_to_main_grads()
        # Collectives first: every rank agrees on the overflow, the norm and the zero count before any
        # state changes.
        found_inf = self.grad_scaler is not None and self._unscale_and_check_for_inf(main_grads)
        grad_norm = num_zeros = None
        stats_grads, distinct_grads = self._grads_for_stats(main_grads)
        if not found_inf and (self.config.clip_grad > 0.0 or self.config.log_grad_norm):
            grad_norm = get_grad_norm_fp32(stats_grads, self.grad_stats_group, self.sharded, self.device,
                                           distinct_grads)
        if not found_inf and self.config.log_num_zeros_in_grad:
            num_zeros = count_zeros_fp32(stats_grads, self.grad_stats_group, self.sharded, self.device,
                                         distinct_grads)
        # The update itself is local (no collective): a rank's failure elsewhere never leaves it half done,
        # and a last-words checkpoint (megatron_lite/checkpointing/last_words.py) waits for it under update_lock.
        with self.update_lock:
            self.updating = True
            if self.grad_scaler is not None:
                self.grad_scaler.update(found_inf)
            if not found_inf:
                if self.config.clip_grad > 0.0:
                    clip_grads_by_total_norm(main_grads, self.config.clip_grad, grad_norm)
                self._grad_staging.to_host()  # offloaded main params: their grads, unscaled and clipped
                self.optimizer.step()
                self.update_count += 1
            self.steps_taken += 1
            self.last_step_successful = not found_inf
            self.updating = False
        self._grad_staging.clear()
        for p in self._main_params():
            p.grad = None  # fp32 copies of the grads (fp16/bf16 grads) are not needed any more
        if found_inf:
            return False, None, None
        self._copy_main_params_to_model_params()
        return True, None if grad_norm is None else grad_norm.item(), num_zeros

    def _unscale_and_check_for_inf(self, main_grads: List[torch.Tensor]) -> bool:
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        if main_grads:
            inv_scale = torch.tensor(1.0 / self.grad_scaler.scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, inv_scale)
        # Every rank must make the same skip decision (an overflow may sit in one rank's shard only).
        collectives.all_reduce(found_inf, self.grad_stats_group, op=collectives.MAX)
        return bool(found_inf.item() > 0)

    # ------------------------------------------------------------------ subclass hooks
    def _prepare_for_step(self):
        pass

    def _main_params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _copy_model_grads_to_main_grads(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def _set_main_grad(self, main: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Give `main` its gradient `grad` (fp32, on the model's device) and return `grad`, which the norm,
        the overflow check and clipping then read and change in place. A main param in host memory
        (optimizer_cpu_offload) gets a host copy of it just before the update (GradStaging)."""
        if main.device == grad.device:
            main.grad = grad
        else:
            self._grad_staging.add(main, grad)
        return grad

    def _grads_for_stats(self, main_grads: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[list]]:
        """(grads, distinct_grads) for the norm and the zero count (clip_grads.py), so that every element
        counts once: shards are disjoint over grad_stats_group, expert shards included (they are disjoint
        over their expert group, and the groups hold different experts), so all are `grads`. The full-
        gradient optimizers override this for models with expert parameters."""
        return main_grads, None

    def _skipped(self) -> frozenset:
        """Model parameters no rank got a gradient for (find_unused_parameters): their main params keep
        .grad None, so the inner optimizer leaves them, moments and step count included, as torch does."""
        skipped = frozenset()
        for chunk in self.model_chunks:
            skipped |= chunk.unused_params
        return skipped

    def _copy_main_params_to_model_params(self):
        raise NotImplementedError

    def _copy_model_params_to_main_params(self):
        raise NotImplementedError

    @torch.no_grad()
    def reload_model_params(self):
        """Take the model's current parameters as the main params (megatron-core's call after weights were
        written into the model behind the optimizer's back, e.g. model.load_state_dict for fine-tuning):
        fp16/bf16 models have fp32 main copies, which the next step() would otherwise write back over
        the new weights. fp32 main params are the model's own storage: nothing to copy. The optimizer state
        (moments, step counts, loss scale) is kept, as in megatron-core; build a new optimizer for a fresh
        one. Local (no collective): every rank must hold the new weights of its own parameters or shards.
        """
        for chunk in self.model_chunks:
            chunk.finish_param_sync()  # a pending all-gather must not land after the copy
        with self.update_lock:  # a last-words record reads the main params under it
            self._copy_model_params_to_main_params()

    # ------------------------------------------------------------------ state (see sharded_state.py)
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


def main_param(model_data: torch.Tensor) -> torch.nn.Parameter:
    """The fp32 tensor the inner optimizer steps for `model_data` (a parameter, or a rank's shard of a
    param buffer): fp32 data itself, so the update lands in the model in place; else an fp32 copy."""
    if model_data.dtype == torch.float32:
        return model_data if isinstance(model_data, torch.nn.Parameter) else torch.nn.Parameter(model_data)
    return torch.nn.Parameter(model_data.detach().float())  # .float() of another dtype is a new tensor


def main_params(model_datas: List[torch.Tensor], config: OptimizerConfig) -> List[torch.nn.Parameter]:
    """main_param of each of `model_datas` (in the inner optimizer's order), except that with
    config.optimizer_cpu_offload the planned share of them is an fp32 copy in host memory (cpu_offload.py)."""
    on_host = [False] * len(model_datas)
    if config.optimizer_cpu_offload:
        on_host = offload_plan(model_datas, config.optimizer_offload_fraction)
    return [host_main_param(t) if host else main_param(t) for t, host in zip(model_datas, on_host)]


def _is_model_data(main: torch.Tensor, model_data: torch.Tensor) -> bool:
    return main.device == model_data.device and main.data_ptr() == model_data.data_ptr()


def copy_main_to_model(main: torch.Tensor, model_data: torch.Tensor):
    """Write an updated main param back into the model (a cast, or a copy from host memory); nothing to do
    when it is the model's data. From pinned host memory the copy is asynchronous: later work on the
    device (the parameter all-gather) is queued behind it."""
    if not _is_model_data(main, model_data):
        from_host = main.device.type == "cpu" and model_data.device.type != "cpu"
        model_data.copy_(main.detach().view_as(model_data), non_blocking=from_host and main.is_pinned())


def copy_model_to_main(model_data: torch.Tensor, main: torch.Tensor):
    """The reverse of copy_main_to_model: the model's values into its fp32 main copy."""
    if not _is_model_data(main, model_data):
        main.data.copy_(model_data.view_as(main))


def qualified_param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """Trainable parameter -> name (prefixed by the chunk index when there are several chunks)."""
    names = {}
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        for param, name in chunk.param_to_name.items():
            names[param] = prefix + name
    return names


def make_grad_scaler(config: OptimizerConfig):
    """Megatron's choice: a constant scale when one is given (fp16 or bf16), dynamic scaling for fp16."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if not config.fp16:
        return None
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
        growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
    )
