"""Megatron-style data parallelism: gradient buffers, grad-ready hooks and bucketed collectives.

Key steps of one iteration (see docs/ddp_buffer_and_buckets.md for a worked example)::

    model.zero_grad_buffer()                 # main_grad := 0, buckets forget the last iteration
    for mb in micro_batches[:-1]:
        with model.no_sync():                # hooks only accumulate into main_grad
            loss(mb).backward()
    loss(micro_batches[-1]).backward()       # hooks accumulate, mark params ready; with
                                             # overlap_grad_reduce each complete bucket's collective
                                             # is launched right away, while backward goes on
    model.finish_grad_sync()                 # launch what is left, wait for everything
    optimizer.step()

This module builds the wrapper (buffers, buckets) and the two objects it holds: the gradient synchronization
(`grad_sync`, grad_sync.py: the hooks and the gradient side of the protocol above, no_sync, start/finish_grad_sync,
zero_grad_buffer) and the parameter synchronization (`param_sync`, param_sync.py). The wrapper's calls of the
protocol are thin delegations to them. Buckets are launched in one fixed order (the order their gradients are
expected in backward), never in the order they happen to complete: every rank then issues the same sequence of
collectives even when autograd visits parameters in a rank-dependent order (grad_sync.py).

A model built on the meta device (meta_init.py: `meta_device_init()`, or modules with `reset_parameters()`)
is materialized here (materialize.py): every tensor gets storage on `init_device` (ZeRO-3: only this rank's
shards, in the buckets), and its initial values are computed one tensor at a time and kept where this rank
holds them, bit-identical to wrapping the same model built normally.

The sharding strategy is decided once (config.sharding): it shapes the buffers and buckets (what a rank
keeps) and picks the parameter synchronization object (param_sync.py) that every parameter-side call
below goes to; the wrapper itself never asks which strategy it runs.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .expert_parallel import expert_topology, gradient_scaling_factors, is_expert_param
from .fsdp_units import persistent_params_together, units_of
from .grad_sync import GradSync, launch_order
from .layout import DataParallelTopology, default_bucket_size
from .materialize import MetaMaterializer, has_meta_tensors
from .model_checks import raise_if_unsupported_model
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer, fp32_local_accumulation_params
from .param_sync import ParamSync, build_param_sync
from .replica_check import check_replicas_agree

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """Wrap `module` for data-parallel training with Megatron's buffer/bucket scheme.

    Args:
        module: any nn.Module, on the device its collectives run on (CPU for gloo, CUDA for NCCL).
            Replicas must start identical (same seed, or call `broadcast_params()`).
        config: a DistributedDataParallelConfig.
        data_parallel_group: process group to average gradients over (default: WORLD).
        expert_data_parallel_group: this rank's group of ranks holding the same experts: the gradients of
            parameters marked `param.allreduce = False` (megatron-core's expert marker) are reduced over it
            instead, in buffers of their own (`expert_parallel_buffers`), see expert_parallel.py. Required
            when any rank has a marked parameter; None otherwise.
        init_device: where a model built on the meta device is materialized (materialize.py); default: the
            current CUDA device when `data_parallel_group`'s backend is NCCL, else the CPU. Ignored for a
            model that is not on the meta device.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: DistributedDataParallelConfig,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        expert_data_parallel_group: Optional[dist.ProcessGroup] = None,
        init_device: Optional[torch.device] = None,
    ):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(config, DistributedDataParallelConfig):
            raise TypeError(f"config must be a DistributedDataParallelConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "(e.g. launch with torchrun) before wrapping the model"
            )
        raise_if_unsupported_model(module)  # sparse gradients, Parameters aliasing each other's memory
        # A meta model: checked for initializers (before anything is allocated), then given storage on the
        # device (ZeRO-3: placeholders for what the buckets shard); values come after the buffers exist.
        materializer = None
        if has_meta_tensors(module):
            materializer = MetaMaterializer(module)
            if init_device is None:
                nccl = dist.get_backend(data_parallel_group) == "nccl"
                init_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            sharded = config.sharding.parameters
            materializer.placeholders(torch.device(init_device),
                                      whole=lambda t: not (sharded and isinstance(t, torch.nn.Parameter)
                                                           and t.requires_grad))
        self.module = module
        self.ddp_config = config
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.data_parallel_rank = dist.get_rank(data_parallel_group)
        # Distributed-optimizer instances: the buffers shard (reduce-scatter, all-gather) over the ranks of
        # this rank's instance; the shards are all-reduced with the same position of the other instances.
        # Who holds which shard is decided here once; the optimizer and checkpoints ask this record.
        self.data_parallel_groups = collectives.DataParallelGroups.build(data_parallel_group, DataParallelTopology(
            self.data_parallel_world_size, config.num_distributed_optimizer_instances))
        groups = self.data_parallel_groups

        # Megatron's rule: default size with overlap, a single bucket without (nothing to overlap).
        bucket_size = config.bucket_size
        if config.num_buckets is not None:  # Megatron: every parameter of the chunk counts, frozen ones too
            bucket_size = max(1, sum(p.numel() for p in module.parameters()) // config.num_buckets)
        elif bucket_size is None:
            bucket_size = default_bucket_size(self.data_parallel_world_size)
        self.bucket_size = bucket_size if config.overlap_grad_reduce else None

        # Expert parameters: validated on every rank at once (one collective), before anything else is.
        self.expert_data_parallel_group = expert_data_parallel_group
        self.expert_topology = expert_topology(list(module.named_parameters()), data_parallel_group,
                                               expert_data_parallel_group)
        has_experts = self.expert_topology is not None and self.expert_topology.has_expert_params
        if has_experts and config.num_distributed_optimizer_instances > 1:
            raise ValueError("num_distributed_optimizer_instances > 1 is not supported with expert parameters "
                             "(param.allreduce = False) yet: use one distributed-optimizer instance")
        # Every rank must wrap the same model with the same config, or the collectives pair up wrong buckets
        # (expert parameters: every rank of the expert data-parallel group).
        check_replicas_agree(module, config, data_parallel_group, expert_data_parallel_group if has_experts else None)
        # named_parameters() yields a tied parameter once, under its first name.
        # (name, param, requires_grad at wrap time), frozen ones too: a later change is an error.
        named_params = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self.param_to_name: Dict[torch.nn.Parameter, str] = {}
        # Buffers per (param dtype, grad dtype, expert or not), as megatron-core's. The grad dtype is what the
        # buffer communicates; a parameter matched by param_name_patterns_for_fp32_local_accumulation keeps
        # that grad dtype but accumulates into an fp32 main_grad of its own (param_and_grad_buffer.py).
        fp32_accumulation = fp32_local_accumulation_params(
            [(n, p) for n, p, _ in named_params], config, data_parallel_group)
        dtype_to_params: Dict[Tuple[torch.dtype, torch.dtype, bool], List[torch.nn.Parameter]] = {}
        for name, param, _ in named_params:
            if not param.requires_grad:
                continue
            param.grad_added_to_main_grad = False  # megatron-core's flag for fused weight-gradient layers
            self.param_to_name[param] = name
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            dtype_to_params.setdefault((param.dtype, grad_dtype, is_expert_param(param)), []).append(param)

        # Pre-scale by 1/dp and sum = the mean over ranks; a per-token loss is summed (scaled after the reduction).
        # Expert gradients end as their expert group's sum / dp (megatron-core's rule, see expert_parallel.py).
        scaling, expert_scaling = gradient_scaling_factors(
            self.data_parallel_world_size, dist.get_world_size(expert_data_parallel_group) if has_experts else 1,
            config.average_in_collective, config.calculate_per_token_loss)
        units, unit_of = units_of(module, config)  # ZeRO-3's units of gathering; none otherwise
        self.param_and_grad_buffers: List[ParamAndGradBuffer] = []
        self.expert_parallel_buffers: List[ParamAndGradBuffer] = []  # reduced over expert_data_parallel_group
        for (param_dtype, grad_dtype, expert), params in dtype_to_params.items():
            params = persistent_params_together(params, unit_of)  # ZeRO-3: a bucket of their own
            group, inter = (expert_data_parallel_group, None) if expert else (groups.intra_instance_group,
                                                                               groups.inter_instance_group)
            (self.expert_parallel_buffers if expert else self.param_and_grad_buffers).append(ParamAndGradBuffer(
                config, param_dtype, grad_dtype, params, group, self.bucket_size, self.param_to_name,
                expert_scaling if expert else scaling, unit_of, inter, fp32_local_accumulation=fp32_accumulation,
            ))
        self.expert_params = frozenset(p for buffer in self.expert_parallel_buffers for p in buffer.params)
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for buffer in self.param_and_grad_buffers + self.expert_parallel_buffers:
            self.param_to_bucket.update(buffer.param_to_bucket)
        if materializer is not None:
            materializer.run(self._keep_initial_value)

        # broadcast_buffers: whether to copy rank 0's buffers before the next forward (torch DDP's rule, see
        # the config field); looked up per forward, since models may replace a buffer tensor.
        self._sync_buffers = config.broadcast_buffers and any(True for _ in module.buffers())
        self._buffers_stale = True

        # The buckets' gradient collectives in one fixed launch order (grad_sync.py); gathers in its reverse.
        buffers = self.param_and_grad_buffers + self.expert_parallel_buffers
        all_buckets = [b for buffer in buffers for b in buffer.buckets]
        order = launch_order(all_buckets, list(self.param_to_name))
        # Gathers, releases and the hooks around forward and backward (param_sync.py).
        self.param_sync: ParamSync = build_param_sync(module, config, all_buckets, order, units, unit_of,
                                                      groups.intra_instance_group)
        # The gradient side: one hook per parameter, this iteration's state, the launch schedule (grad_sync.py).
        self.grad_sync = GradSync(module, config, buffers, self.param_to_bucket, self.param_to_name, named_params,
                                  self.expert_params, order, self.param_sync, data_parallel_group,
                                  expert_data_parallel_group)

    @torch.no_grad()
    def _keep_initial_value(self, tensor: torch.Tensor, value: torch.Tensor):
        """A meta-built tensor's initial value (full, on the CPU): ZeRO-3 keeps the part in this rank's shard
        of its bucket; every other tensor holds it whole (its own storage, or its view into the buffer)."""
        bucket = self.param_to_bucket.get(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        if bucket is None or not bucket.shards_params:
            tensor.data.copy_(value)
            return
        part = bucket.param_to_owned_range.get(tensor)  # none: no element of the parameter is this rank's
        if part is not None:
            bucket.param_shard[part.shard_start:part.shard_start + part.buffer_end - part.buffer_start].copy_(
                value.reshape(-1)[part.param_start:part.param_end])

    @property
    def data_parallel_topology(self) -> DataParallelTopology:
        """Who holds which shard (the record's topology, data_parallel_groups.topology): what the optimizer
        and checkpoints ask."""
        return self.data_parallel_groups.topology

    @property
    def shards_params(self) -> bool:
        """Whether this rank keeps only a shard of the parameters (ZeRO-3): readers of the parameters
        outside full_parameters() see placeholders."""
        return self.ddp_config.sharding.parameters

    def forward(self, *args, **kwargs):
        if self._sync_buffers and self._buffers_stale:
            collectives.broadcast_coalesced(list(self.module.buffers()), group=self.data_parallel_group)
        self._buffers_stale = torch.is_grad_enabled() and self.grad_sync.is_last_microbatch
        self.param_sync.begin_forward()
        self.grad_sync.begin_forward()  # gradient_as_bucket_view: autograd accumulates into main_grad
        output = self.module(*args, **kwargs)
        self.param_sync.end_forward()
        return output

    # ---------------------------------------------------------------- gradient synchronization (grad_sync.py)
    def zero_grad_buffer(self):
        """Zero all main_grads and reset bucket state; call at the start of every iteration."""
        self.grad_sync.reset()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients of backward passes inside the context accumulate in main_grad; nothing is communicated."""
        return self.grad_sync.no_sync()

    def start_grad_sync(self, *unused):
        """Launch the collectives of all buckets not launched yet (async with overlap_grad_reduce).
        Positional arguments (megatron-core's signature: a hook's arguments) are ignored."""
        self.grad_sync.start()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Complete gradient synchronization; afterwards main_grad holds the data-parallel mean (with the
        distributed optimizer: in this rank's shard of every bucket).

        With overlap_grad_reduce, buckets still waiting for parameters mean some parameters got no
        gradient in this iteration: an error naming them, unless `find_unused_parameters` is set, in
        which case their (zero) contribution is communicated now.

        `force_all_reduce` (megatron-core's argument): with the distributed optimizer, every rank ends with
        the whole reduced gradient, not just its shard (buckets not launched yet are all-reduced, the others'
        reduced shards all-gathered). Not with ZeRO-2/3, which keep no full gradients. None is False, as in
        megatron-core (Optional[bool]).
        """
        self.grad_sync.finish(bool(force_all_reduce))

    def scale_gradients(self, scaling_factor: float):
        """Multiply every main_grad by `scaling_factor`."""
        self.grad_sync.scale_gradients(scaling_factor)

    def check_ready_for_step(self):
        """Raise unless every gradient of this iteration's backward passes was synchronized (called by the
        optimizer's step(): stepping on unreduced gradients silently makes the replicas diverge)."""
        self.grad_sync.check_ready_for_step()

    @property
    def unused_params(self) -> frozenset:
        """find_unused_parameters: the parameters no rank got a gradient for in the last iteration (the
        optimizer leaves them alone, as torch's optimizers skip a parameter whose .grad is None)."""
        return self.grad_sync.unused_params

    def remove_grad_hooks(self):
        """Unregister the gradient-ready hooks from the parameters (live recovery discards a wrapper after a
        failure; see GradSync.remove_hooks)."""
        self.grad_sync.remove_hooks()

    # ---------------------------------------------------------------- parameter all-gather
    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """All-gather every bucket's updated parameter shards (called by the DistributedOptimizer).

        With overlap_param_gather (unless `force_sync`) nothing is sent yet: the forward pre-hooks dispatch
        and wait for the gathers as forward reaches the buckets (param_gather.py). ZeRO-3: the stale full
        parameters are released, and the units gather the new shards on demand (param_units.py).

        megatron-core's signature: positional arguments (a hook's) are ignored, and `force_dispatch` is
        accepted with nothing to override: it only lifts megatron-core's overlap of the gather with the
        optimizer step, which megatron-lite does not have (a call always starts the gathers).
        """
        self.param_sync.start(force_sync)

    def finish_param_sync(self):
        """Complete all pending parameter gathers (before checkpointing, evaluation or the next step)."""
        self.param_sync.finish()

    def free_overlap_buffers(self):
        """megatron-core's call before an asynchronous checkpoint save: complete pending parameter gathers
        (megatron-lite keeps no separate overlap buffers to free: the gathers land in the param buffer)."""
        self.finish_param_sync()

    def full_parameters(self, write_back: bool = False):
        """ZeRO-3: every parameter gathered inside the context (released after it; with `write_back`, what
        was written into them is kept as the new shards). Other strategies: nothing to do."""
        return self.param_sync.full_parameters(write_back)

    def broadcast_params(self):
        """Copy every parameter from data-parallel rank 0 to the other ranks (an expert parameter: from rank 0
        of its expert data-parallel group)."""
        with self.full_parameters(write_back=True):
            for param in self.module.parameters():
                expert = is_expert_param(param) and self.expert_data_parallel_group is not None
                collectives.broadcast(param.data, group=self.expert_data_parallel_group if expert
                                      else self.data_parallel_group)

    # A Megatron checkpoint holds the bare module's keys, without a `module.` prefix.
    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()  # never save parameters whose all-gather is still pending
        # ZeRO-3: read unit by unit (one unit gathered at a time) and copied, on the parameters' device.
        return self.param_sync.state_dict(self.module, *args, **kwargs)

    def iter_full_state_dict(self, rank0_only: bool = False,
                             cpu_offload: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The bare module's state dict, streamed: `(key, tensor)` for every entry of `module.state_dict()`, in
        its order (buffers included, a tied parameter under each of its names), each tensor a full copy.

        ZeRO-3 gathers one unit at a time (the root's and the persistent parameters for the whole export):
        each unit's entries are copied, then it is released before the next one is gathered, so exporting
        never needs the whole model gathered (full_state_dict.py). Other strategies hold whole parameters and
        only copy them. `dict(model.iter_full_state_dict())` is `state_dict()`, bitwise.

        Collective: call it on every rank of the data-parallel group and iterate to the end (stopping early
        still issues the gathers left, when the generator is closed).

        Args:
            rank0_only: only data-parallel rank 0 receives entries (FSDP's option of that name); the other
                ranks still take part in every gather, and their iteration yields nothing.
            cpu_offload: copy to the CPU (the default: the device then holds at most one gathered unit and
                the root); False keeps the copies on the parameters' device.
        """
        self.finish_param_sync()  # never read parameters whose all-gather is still pending
        receives = not rank0_only or self.data_parallel_rank == 0
        for key, value in self.param_sync.iter_state_dict(self.module):
            if receives:
                yield key, (value.to("cpu" if cpu_offload else value.device, copy=True)
                            if isinstance(value, torch.Tensor) else value)

    def untrained_state_dict(self) -> Dict[str, torch.Tensor]:
        """The bare module's state entries that are not trainable parameters (buffers, frozen parameters),
        read without gathering anything: what a sharded checkpoint saves whole, next to the shards."""
        with self.param_sync.reading_placeholders():
            state = self.module.state_dict()
        trainable = set(self.param_to_name.values())
        return {k: v for k, v in state.items() if k not in trainable}

    def tied_names(self) -> Dict[str, str]:
        """Every further name of a trained parameter (a tied weight: `head.weight = embed.weight`) -> the name it
        is trained under (param_to_name). Checkpoints store the tensor once, under the latter."""
        return {n: self.param_to_name[p] for n, p in self.module.named_parameters(remove_duplicate=False)
                if p in self.param_to_name and self.param_to_name[p] != n}

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        self.finish_param_sync()  # a pending gather must not overwrite the loaded values later
        with self.full_parameters(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
