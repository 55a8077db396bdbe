"""Megatron's optimizer protocol (MegatronOptimizer): the step every implementation shares, and the state
methods (state_dict, sharded_state, the agreed step counts) over the ShardState it holds. The non-sharded
implementations are in full_param_optimizer.py, the sharded one in distrib_optimizer.py; what they step
(fp32 main params) is main_params.py; the state of what they step (described, restored) optimizer_state.py.

    step():  main grads <- model main_grad      (alias for fp32; fp32 copy for fp16/bf16)
             collectives: fp16 inf/NaN check agreed by all ranks; global grad norm (and zero count)
             optimizer='muon', unless overflow: clip -> momentum updates (out of place) -> _orthogonalize
             local update, under update_lock: loss scaler; unless overflow: clip (not Muon) -> inner optimizer step
             model params <- main params         (cast; the distributed optimizer then all-gathers)
             returns (update_successful, grad_norm, num_zeros_in_grad)
"""

import dataclasses
import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology
from .clip_grads import clip_grads_by_total_norm, count_zeros_fp32, get_grad_norm_fp32
from .cpu_offload import GradStaging
from .elementwise import optimizer_kind
from .muon import MUON_GROUP_KEYS, matrix_specs, orthogonalize
from .optimizer_config import OptimizerConfig
from .optimizer_state import MainShard, ShardState, cut_shards
from .sharded_state import ShardedOptimizerState, flat_numel, flatten, unflatten

__all__ = ["MegatronOptimizer", "qualified_param_names"]


class MegatronOptimizer:
    """Shared step() logic; subclasses decide what the main params are and how results reach the model.

    Args:
        optimizer: the inner torch optimizer, over the main params.
        config: the OptimizerConfig.
        model_chunks: the DistributedDataParallel-wrapped model chunks.
        grad_scaler: loss scaler (fp16 only) or None.
        main_shards: what the inner optimizer steps (MainShard), in its order; they and their state make
            up `shard_state`.
    The main params (what the inner optimizer steps) are built by `main_param` in every subclass: the
    model's fp32 data itself, or an fp32 copy of fp16/bf16 data; the distributed optimizer does this for
    the rank's shards only.
    """

    sharded = False  # whether each rank holds only a shard of the main params / grads
    params_sharded = False  # whether the model, too, keeps only the rank's shards of its parameters (ZeRO-3)

    def __init__(self, optimizer, config: OptimizerConfig, model_chunks, grad_scaler, main_shards: List[MainShard]):
        self.optimizer = optimizer
        self.config = config
        self.model_chunks = model_chunks
        self.grad_scaler = grad_scaler
        self.data_parallel_group = model_chunks[0].data_parallel_group
        # Where each gradient element lives exactly once: the data-parallel group, or with several
        # distributed-optimizer instances this rank's instance (the others hold replicas of the same
        # shards, which must not be counted twice in the norm, the zero count or the overflow check).
        self.grad_stats_group = model_chunks[0].data_parallel_groups.intra_instance_group
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
        self.last_grad_norm = None  # the last step()'s gradient norm (a tensor; None: skipped or not computed)
        self._grad_staging = GradStaging()  # optimizer_cpu_offload: the host copies of the main grads
        self.shard_state = ShardState(optimizer, optimizer_kind(config), main_shards, self.param_to_name, grad_scaler)
        # optimizer='muon': each model parameter's MatrixSpec (None: AdamW's), and for the inner optimizer each
        # Muon main tensor's matrix and range.
        self.matrix_specs = matrix_specs(model_chunks, config) if config.optimizer == "muon" else {}
        if self.matrix_specs:
            self._attach_matrices(main_shards)

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
        muon = bool(self.matrix_specs)
        orthogonalized = None
        if muon and not found_inf:
            # Muon orthogonalizes the momentum of the clipped gradients, which may take other ranks' pieces of a
            # matrix (collectives): clipped here, outside the lock (gradients are not optimizer state), and the
            # momentum computed out of place, so that the state changes only under the lock below.
            if self.config.clip_grad > 0.0:
                clip_grads_by_total_norm(main_grads, self.config.clip_grad, grad_norm)
            updates = self.optimizer.momentum_updates()
            pieces = self._orthogonalize({shard: updates[shard.main].reshape(-1)
                                          for shard in self.shard_state.main_shards if shard.main in updates})
            orthogonalized = {shard.main: o for shard, o in pieces.items()}
        # The update itself is local (no collective): a rank's failure elsewhere never leaves it half done,
        # and a last-words checkpoint (megatron_lite/checkpointing/last_words.py) waits for it under update_lock.
        with self.update_lock:
            self.updating = True
            if self.grad_scaler is not None:
                self.grad_scaler.update(found_inf)
            if not found_inf:
                if self.config.clip_grad > 0.0 and not muon:
                    clip_grads_by_total_norm(main_grads, self.config.clip_grad, grad_norm)
                self._grad_staging.to_host()  # offloaded main params: their grads, unscaled and clipped
                if muon:
                    self.optimizer.step(orthogonalized)
                else:
                    self.optimizer.step()
                self.update_count += 1
            self.steps_taken += 1
            self.last_step_successful = not found_inf
            self.last_grad_norm = grad_norm  # read by live recovery when a failure cuts step() short below
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

    def _orthogonalize(self, updates: Dict[MainShard, torch.Tensor]) -> Dict[MainShard, torch.Tensor]:
        """optimizer='muon': the orthogonalized update of each Muon main shard. `updates`: {MainShard: its flat
        fp32 momentum update u}, for the shards with a gradient; returns {MainShard: its flat piece of O}, O =
        muon.orthogonalize of the whole parameter's u (each block of a split QKV its own matrix; bfloat16, as
        Newton-Schulz leaves it). The distributed optimizer, whose shards cut matrices anywhere, overrides this
        (the exchange); here every shard is a whole parameter, orthogonalized locally. Collective where
        overridden: every rank calls it at every Muon step, also with no updates."""
        out = {}
        for shard, u in updates.items():
            spec = self.matrix_specs[shard.param]
            if shard.start != 0 or shard.end != spec.rows * spec.cols:
                raise NotImplementedError(f"{type(self).__name__}: Muon main shard [{shard.start}, {shard.end}) of "
                                          f"{self.param_to_name[shard.param]} is not the whole parameter: the "
                                          f"optimizer must override _orthogonalize to gather its matrices")
            out[shard] = orthogonalize(u, spec, self.config)
        return out

    def _attach_matrices(self, main_shards: List[MainShard]):
        """Tell the inner Muon optimizer which matrix and range each of its Muon main tensors is, after checking
        that the param groups put exactly the matrices on Muon (a parameter silently left to AdamW, or the
        reverse, raises)."""
        on_muon = {id(p) for g in self.optimizer.param_groups if g.get("use_muon") for p in g["params"]}
        matrices = {}
        for shard in main_shards:
            spec = self.matrix_specs.get(shard.param)
            if (spec is not None) != (id(shard.main) in on_muon):
                raise ValueError(f"parameter {self.param_to_name[shard.param]} is in a "
                                 f"{'Muon' if id(shard.main) in on_muon else 'AdamW'} param group but Muon's rule "
                                 f"(muon.matrix_specs) says {'AdamW' if spec is None else 'Muon'}")
            if spec is not None:
                matrices[shard.main] = (spec, shard.start, shard.end)
        self.optimizer.matrices = matrices

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

    def _copy_model_params_to_main_params(self, values: Optional[Dict[torch.nn.Parameter, torch.Tensor]] = None):
        """The main params from the model's parameters or, with `values`, from values[param] (whole
        parameters, any dtype and device), in whatever part of each parameter this optimizer steps."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state (optimizer_state.py)
    @property
    def data_parallel_topology(self) -> DataParallelTopology:
        """Who holds which shard: the distributed optimizer's instances; for the full-parameter optimizers
        every rank a whole copy, i.e. one position held by every rank."""
        world = dist.get_world_size(self.data_parallel_group)
        return DataParallelTopology(world, world)

    def sharded_state(self) -> ShardedOptimizerState:
        """This rank's optimizer state as shards of named flat parameters (megatron-core's sharded_state_dict;
        views of the live state, not copies). Local: no collective."""
        return self.shard_state.describe(self.update_count, self._model_shards())

    def _model_shards(self) -> Optional[List[torch.Tensor]]:
        """ZeRO-3: the model's own copy of each main shard (ParamShard.model_data); None where the model
        keeps whole parameters."""
        return None

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
        self.shard_state.load(state, adopt)
        self.update_count = state.step

    # ------------------------------------------------------------------ replicas (fault tolerance)
    # The non-sharded optimizers: every rank a replica of every other (data_parallel_topology), so live
    # recovery heals a replacement of `no_shard` from any survivor; the distributed optimizer's replicas are the
    # ranks at its position in the other instances. Only the model write differs (_write_received_state).
    def holds_same_shards(self, rank: int) -> bool:
        """Whether data-parallel rank `rank` holds the same shards as this rank (a replica, or this rank)."""
        topology = self.data_parallel_topology
        return topology.position(rank) == topology.position(dist.get_rank(self.data_parallel_group))

    @torch.no_grad()
    def send_shard_state(self, dst: int):
        """Send this rank's main params, optimizer state and step to data-parallel rank `dst`, which must hold
        the same shards and call recv_shard_state(src=this rank). Point to point: no other rank takes part."""
        if not self.holds_same_shards(dst):
            raise ValueError(f"send_shard_state(dst={dst}): rank {dst} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; send to a replica")
        collectives.send(flatten(self.sharded_state(), self.device), dst, self.data_parallel_group)

    @torch.no_grad()
    def recv_shard_state(self, src: int):
        """Replace this rank's main params, optimizer state and step by those of replica `src` (which calls
        send_shard_state(dst=this rank)) and write the params into the model, locally. A replica that is not
        finite, or has negative moments of squares (OptimizerKind.nonnegative_keys), raises ValueError and
        leaves this rank's state untouched."""
        if not self.holds_same_shards(src):
            raise ValueError(f"recv_shard_state(src={src}): rank {src} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; receive from a replica")
        layout = self.sharded_state()
        flat = torch.empty(flat_numel(layout), dtype=torch.float32, device=self.device)
        collectives.recv(flat, src, self.data_parallel_group)
        received = unflatten(flat, layout)
        nonnegative = self.shard_state.kind.nonnegative_keys
        squares = [s.tensors[k] for s in received.shards for k in nonnegative if k in s.tensors]
        if not torch.isfinite(flat).all() or any((t < 0).any() for t in squares):
            raise ValueError(f"recv_shard_state(src={src}): the replica's state is not finite (or has negative "
                             f"values in {', '.join(nonnegative) or 'no state'}, which cannot be); refusing to "
                             f"restore it")
        if not received.step:  # the replica never stepped: neither has this rank's state now
            self.shard_state.forget_moments()
            received = received.params_only()
        self._load_shards(received)
        self._write_received_state()

    def _write_received_state(self):
        """After recv_shard_state: the received main params into the model, locally (no collective)."""
        self._copy_main_params_to_model_params()  # the full-parameter optimizers: local

    @torch.no_grad()
    def state_dict(self):
        """DP-size- and layout-independent state (the 'torch' format): hyperparameters, per-name fp32 tensors,
        loss scaler. Collective for the distributed optimizer (its shards are gathered)."""
        return {**self.common_state_dict(), "state": self._gathered(self.sharded_state())}

    def _gathered(self, state: ShardedOptimizerState) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: whole fp32 'param' and optimizer-state tensors (CPU copies), plus 'step'."""
        raise NotImplementedError

    @torch.no_grad()
    def load_state_dict(self, state_dict, hyperparameters: str = "check"):
        """Restore the state; the hyperparameters stored with it meet this run's per `hyperparameters`
        ('check', 'override' or 'checkpoint', see pick_hyperparameter). The learning rate is the
        scheduler's business."""
        missing = set(self.param_to_name.values()) - set(state_dict["state"])
        if missing:
            raise ValueError(f"optimizer checkpoint lacks parameters: {sorted(missing)[:10]}")
        self.check_state_parts({name: entry.keys() for name, entry in state_dict["state"].items()},
                               {name: entry.get("step") for name, entry in state_dict["state"].items()})
        self.load_common_state_dict(state_dict, hyperparameters)
        self.load_sharded_state(cut_shards(state_dict["state"], self.sharded_state()))

    def state_keys_of(self, param: torch.nn.Parameter) -> Tuple[str, ...]:
        """The optimizer-state keys model parameter `param` carries in every format (for any rank, whether or
        not it holds a shard of it): the kind's, or for optimizer='muon' those of its part (Muon's or AdamW's)."""
        kind = self.shard_state.kind
        if kind.group_kinds is None:
            return kind.state_keys
        return dict(kind.group_kinds)["muon" if self.matrix_specs.get(param) is not None else "adam"].state_keys

    def check_state_parts(self, stored: Dict[str, object], steps: Optional[Dict[str, int]] = None):
        """optimizer='muon': refuse a checkpoint that keeps a parameter's state under the other part (Muon's
        momentum_buffer for a parameter AdamW steps now, or AdamW's moments for a Muon matrix: its use_muon or
        is_embedding_or_output_parameter changed since), which every format would otherwise drop silently,
        restarting that parameter's state. `stored`: {name: the state keys the checkpoint holds for it};
        `steps`: {name: its own step count} where known (0: it never stepped, nothing to lose). The same on
        every rank (the whole checkpoint's names, not this rank's shards)."""
        kind = self.shard_state.kind
        if kind.group_kinds is None:
            return
        for param, name in self.param_to_name.items():
            muon = self.matrix_specs.get(param) is not None
            foreign = sorted((set(kind.state_keys) - set(self.state_keys_of(param))) & set(stored.get(name, ())))
            if foreign and (steps or {}).get(name) != 0:
                raise ValueError(
                    f"the checkpoint keeps {name}'s optimizer state as {'AdamW' if muon else 'Muon'}'s ({foreign}), "
                    f"but this optimizer steps it with {'Muon' if muon else 'AdamW'} (Muon: full shape 2-D, not "
                    f"is_embedding_or_output_parameter, use_muon not False): mark the parameter as it was when the "
                    f"checkpoint was written, or load without the optimizer state (--no-load-optim, "
                    f"load_checkpoint(load_optim=False))")

    def common_state_dict(self) -> dict:
        """What every rank shares: kind, param-group hyperparameters, loss scaler (no tensors of params)."""
        return self.shard_state.common_state_dict()

    def load_common_state_dict(self, state_dict, hyperparameters: str = "check"):
        """The kind check, group-level state with its hyperparameters (see load_state_dict), loss scaler.
        optimizer='muon': the muon_* values the Muon groups end with are this optimizer's config's too (the
        orthogonalization reads them there), and a muon_split_qkv other than the one it was built with (which
        decided its matrices) is refused."""
        if self.matrix_specs and hyperparameters == "checkpoint" and state_dict.get("optimizer") == "muon":
            for saved in state_dict["param_groups"]:
                split = saved.get("muon_split_qkv", self.config.muon_split_qkv)
                if saved.get("use_muon") and split != self.config.muon_split_qkv:
                    raise ValueError(f"muon_split_qkv is {self.config.muon_split_qkv} in this run but {split} in "
                                     f"the checkpoint, and cannot be taken from it (it decides Muon's matrices when "
                                     f"the optimizer is built): build with muon_split_qkv={split} "
                                     f"({'--muon-no-split-qkv' if not split else 'without --muon-no-split-qkv'})")
        self.shard_state.load_common_state_dict(state_dict, hyperparameters)
        if self.matrix_specs:
            values = {k: g[k] for g in self.optimizer.param_groups if g.get("use_muon") for k in MUON_GROUP_KEYS}
            if any(values[k] != getattr(self.config, k) for k in values):
                self.config = dataclasses.replace(self.config, **values)

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

    @torch.no_grad()
    def reload_model_params(self, state_dict: Optional[dict] = None):
        """Take the model's current parameters as the main params (megatron-core's call after weights were
        written into the model behind the optimizer's back, e.g. model.load_state_dict for fine-tuning):
        fp16/bf16 models have fp32 main copies, which the next step() would otherwise write back over
        the new weights. fp32 main params are the model's own storage: nothing to copy. The optimizer state
        (moments, step counts, loss scale) is kept, as in megatron-core; build a new optimizer for a fresh
        one. Local (no collective): every rank must hold the new weights of its own parameters or shards.

        Args:
            state_dict: megatron-core's optional argument: take the main params from its tensors instead
                of the model's (e.g. a checkpoint's fp32 weights, more precise than a bf16 model's). Its
                forms are megatron-core's: the model's state dict (keys: the parameter names, `module.`
                prefixes ignored), {'model': that}, or one per model chunk {'model0': ..., 'model1': ...}
                ('model_0', ... as NeMo writes). The model keeps its weights until the next step() writes
                the main params into it, except where an fp32 main param is the model's own tensor.
        Raises:
            TypeError / ValueError naming what is missing: a state dict without one of the trained
            parameters, or with another shape for it.
        """
        values = None if state_dict is None else self._values_by_param(state_dict)
        for chunk in self.model_chunks:
            chunk.finish_param_sync()  # a pending all-gather must not land after the copy
        with self.update_lock:  # a last-words record reads the main params under it
            self._copy_model_params_to_main_params(values)

    def _values_by_param(self, state_dict) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """Trained parameter -> its tensor in reload_model_params' `state_dict` (megatron-core's forms)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"reload_model_params(state_dict): a dict of tensors, got {type(state_dict).__name__}")
        chunks = self.model_chunks
        prefix = "model" if "model0" in state_dict else "model_" if "model_0" in state_dict else None
        if prefix is not None:
            missing = [f"{prefix}{i}" for i in range(len(chunks)) if f"{prefix}{i}" not in state_dict]
            if missing:
                raise ValueError(f"reload_model_params(state_dict): no {missing} for the optimizer's "
                                 f"{len(chunks)} model chunks")
            per_chunk = [state_dict[f"{prefix}{i}"] for i in range(len(chunks))]
        else:
            per_chunk = [state_dict["model"] if isinstance(state_dict.get("model"), dict) else state_dict]
            if len(chunks) != 1:
                raise ValueError(f"reload_model_params(state_dict): the optimizer has {len(chunks)} model chunks; "
                                 f"give one state dict per chunk, {{'model0': ..., 'model1': ...}}")
        values = {}
        for i, (chunk, entries) in enumerate(zip(chunks, per_chunk)):
            by_name = {_without_module_prefix(key): value for key, value in entries.items()}
            for param, name in chunk.param_to_name.items():
                value = by_name.get(name)
                where = f"{prefix}{i}." if prefix else ""
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"reload_model_params(state_dict): no tensor for the trained parameter "
                                     f"{where}{name}")
                if value.shape != param.shape:
                    raise ValueError(f"reload_model_params(state_dict): {where}{name} has shape "
                                     f"{tuple(value.shape)}, the model's is {tuple(param.shape)}")
                values[param] = value
        return values


def _without_module_prefix(key: str) -> str:
    while key.startswith("module."):  # a state dict of the wrapper (megatron-core strips these too)
        key = key[len("module."):]
    return key


def qualified_param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """Trainable parameter -> name (prefixed by the chunk index when there are several chunks)."""
    names = {}
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        for param, name in chunk.param_to_name.items():
            names[param] = prefix + name
    return names
