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

Buckets are launched in one fixed order (the order their gradients are expected in backward), never in
the order they happen to complete: every rank then issues the same sequence of collectives even when
autograd visits parameters in a rank-dependent order (grad_sync.py).

A model built on the meta device (materialize.py: `meta_device_init()`, or modules with `reset_parameters()`)
is materialized here: every tensor gets storage on `init_device` (ZeRO-3: only this rank's shards, in the
buckets), and its initial values are computed one tensor at a time and kept where this rank holds them,
bit-identical to wrapping the same model built normally.

The sharding strategy is decided once (config.sharding): it shapes the buffers and buckets (what a rank
keeps) and picks the parameter synchronization object (param_sync.py) that every parameter-side call
below goes to; the wrapper itself never asks which strategy it runs.
"""

import contextlib
import functools
import types
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives
from .distributed_data_parallel_config import UNSHARDED_GRADIENT_STRATEGIES, DistributedDataParallelConfig
from .expert_parallel import expert_topology, gradient_scaling_factors, is_expert_param
from .grad_checks import (
    globally_unused_params,
    raise_if_any_rank_found_nonfinite,
    raise_if_requires_grad_changed,
    unused_parameters_message,
)
from .grad_sync import ZERO2_BUCKETS_IN_FLIGHT, GradSyncSchedule
from .layout import DataParallelTopology, default_bucket_size
from .materialize import MetaMaterializer, has_meta_tensors
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer, fp32_local_accumulation_params
from .param_sync import ParamSync, build_param_sync
from .param_units import persistent_params_together, units_of
from .replica_check import check_replicas_agree

__all__ = ["DistributedDataParallel", "ZERO2_BUCKETS_IN_FLIGHT"]


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
        self.data_parallel_topology = DataParallelTopology(self.data_parallel_world_size,
                                                           config.num_distributed_optimizer_instances)
        self.intra_instance_group, self.inter_instance_group = collectives.instance_groups(
            data_parallel_group, self.data_parallel_topology)

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
        self._all_named_params = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self.param_to_name: Dict[torch.nn.Parameter, str] = {}
        # Buffers per (param dtype, grad dtype, expert or not), as megatron-core's. The grad dtype is what the
        # buffer communicates; a parameter matched by param_name_patterns_for_fp32_local_accumulation keeps
        # that grad dtype but accumulates into an fp32 main_grad of its own (param_and_grad_buffer.py).
        fp32_accumulation = fp32_local_accumulation_params(
            [(n, p) for n, p, _ in self._all_named_params], config, data_parallel_group)
        dtype_to_params: Dict[Tuple[torch.dtype, torch.dtype, bool], List[torch.nn.Parameter]] = {}
        for name, param, _ in self._all_named_params:
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
            params = persistent_params_together(params, unit_of, len(units))  # ZeRO-3: a bucket of their own
            group, inter = (expert_data_parallel_group, None) if expert else (self.intra_instance_group,
                                                                               self.inter_instance_group)
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

        # The buckets' gradient collectives in one fixed launch order (grad_sync.py).
        registration = {p: i for i, p in enumerate(self.param_to_name)}
        all_buffers = self.param_and_grad_buffers + self.expert_parallel_buffers
        all_buckets = [b for buffer in all_buffers for b in buffer.buckets]
        self.grad_sync = GradSyncSchedule(all_buckets, registration, config.sharding.gradients)
        self._launch_order: List[Bucket] = self.grad_sync.order
        # This iteration's gradient-sync state: whether finish_grad_sync ran, whether a backward ran since
        # zero_grad_buffer / finish_grad_sync. Updated from the grad hooks, so kept on a plain object:
        # nn.Module.__setattr__ costs microseconds.
        self._grads = types.SimpleNamespace(finalized=False, unsynchronized=False, aliased=False)
        # gradient_as_bucket_view: params whose .grad can be main_grad (same dtype, a persistent buffer).
        self._grad_views = [p for p, bucket in self.param_to_bucket.items() if config.gradient_as_bucket_view
                            and not bucket.shards_grads and p.main_grad.dtype == p.dtype]
        self._overlap = config.overlap_grad_reduce
        self._find_unused = config.find_unused_parameters
        self.unused_params: frozenset = frozenset()  # find_unused_parameters: no rank's gradient in this iteration
        self.is_last_microbatch = True
        # broadcast_buffers: whether to copy rank 0's buffers before the next forward (torch DDP's rule, see
        # the config field); looked up per forward, since models may replace a buffer tensor.
        self._sync_buffers = config.broadcast_buffers and any(True for _ in module.buffers())
        self._grads.buffers_stale = True

        self._grad_hook_handles = []
        for bucket in all_buckets:
            for index, param in enumerate(bucket.params_list):
                self._grad_hook_handles.append(param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready_hook, bucket=bucket, index=index)))

        # Gathers, releases and the hooks around forward and backward (param_sync.py).
        self.param_sync: ParamSync = build_param_sync(module, config, all_buckets, self._launch_order, units,
                                                      unit_of, self.intra_instance_group)

    def remove_grad_hooks(self):
        """Unregister the gradient-ready hooks from the parameters (live recovery discards a wrapper after a
        failure: a hook held by a parameter keeps the wrapper, its buckets and their process groups alive,
        out of the garbage collector's sight, and a gloo group releases its peers only once freed)."""
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles = []

    @torch.no_grad()
    def _keep_initial_value(self, tensor: torch.Tensor, value: torch.Tensor):
        """A meta-built tensor's initial value (full, on the CPU): ZeRO-3 keeps the part in this rank's shard
        of its bucket; every other tensor holds it whole (its own storage, or its view into the buffer)."""
        bucket = self.param_to_bucket.get(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        if bucket is None or not bucket.shards_params:
            tensor.data.copy_(value)
            return
        start, end = bucket.param_to_index[tensor]
        low, high = max(start, bucket.shard_offset), min(end, bucket.shard_offset + bucket.shard_size)
        if low < high:
            bucket.param_shard[low - bucket.shard_offset:high - bucket.shard_offset].copy_(
                value.reshape(-1)[low - start:high - start])

    @property
    def shards_params(self) -> bool:
        """Whether this rank keeps only a shard of the parameters (ZeRO-3): readers of the parameters
        outside full_parameters() see placeholders."""
        return self.ddp_config.sharding.parameters

    # Read-only names kept for callers and tests of the strategy-specific objects.
    zero3 = shards_params

    @property
    def param_units(self):
        """ZeRO-3's ParamUnits (the parameter synchronization), or None where parameters are not sharded."""
        return self.param_sync if self.shards_params else None

    @property
    def param_gather(self):
        """The parameter synchronization (param_sync.py)."""
        return self.param_sync

    # ---------------------------------------------------------------- hooks and launching
    def _grad_ready_hook(self, param: torch.nn.Parameter, bucket: Bucket, index: int):
        """Runs after autograd accumulated `param.grad` (= bucket.params_list[index]): move it into
        main_grad and, on the last micro-batch with overlap, mark it ready and maybe launch buckets."""
        if self._grads.finalized:
            raise RuntimeError(
                f"gradient for {self.param_to_name[param]} arrived after finish_grad_sync(): call "
                f"zero_grad_buffer() at the start of every iteration"
            )
        self._grads.unsynchronized = True
        if self._find_unused:
            bucket.grad_seen[index] = True
        report_ready = self._overlap and self.is_last_microbatch
        if report_ready:
            bucket.check_accepts_grad(index)  # before touching main_grad: it may be in flight
        grad = param.grad
        if grad is not None:
            bucket.ensure_grad_storage()  # ZeRO-2: the bucket's gradients are freed between iterations
            main_grad = param.main_grad
            if grad.data_ptr() == main_grad.data_ptr():
                # .grad aliases main_grad (gradient_as_bucket_view, or FP32Optimizer's step left it so):
                # autograd accumulated into the buffer in place; the alias stays for the next micro-batch.
                if param.grad_added_to_main_grad:
                    raise ValueError(f"{self.param_to_name[param]}: a fused weight-gradient layer added into "
                                     f"main_grad while .grad aliases it (its dummy gradient was added too): wrap "
                                     f"with gradient_as_bucket_view=False")
            else:
                # Skip the add when a fused weight-gradient layer already added the gradient
                # (grad_added_to_main_grad, as in megatron-core).
                if not param.grad_added_to_main_grad:
                    main_grad.add_(grad)  # main_grad is a view into the buffer: only add_ into it
                param.grad = None
        if report_ready and bucket.mark_ready(index):
            self.grad_sync.launch_ready()
        self.param_sync.grad_arrived(bucket, index)  # ZeRO-3: its backward done, release the full parameters

    # ---------------------------------------------------------------- the public protocol
    def forward(self, *args, **kwargs):
        if self._sync_buffers and self._grads.buffers_stale:
            collectives.broadcast_coalesced(list(self.module.buffers()), group=self.data_parallel_group)
        self._grads.buffers_stale = torch.is_grad_enabled() and self.is_last_microbatch
        self.param_sync.begin_forward()
        if not self._grads.aliased:  # gradient_as_bucket_view: autograd accumulates into main_grad
            for param in self._grad_views:
                param.grad = param.main_grad
            self._grads.aliased = True
        output = self.module(*args, **kwargs)
        self.param_sync.end_forward()
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside the context accumulate in main_grad; nothing is communicated."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self):
        """Launch the collectives of all buckets not launched yet (async with overlap_grad_reduce)."""
        self.grad_sync.launch_rest()

    def finish_grad_sync(self, force_all_reduce: bool = False):
        """Complete gradient synchronization; afterwards main_grad holds the data-parallel mean (with the
        distributed optimizer: in this rank's shard of every bucket).

        With overlap_grad_reduce, buckets still waiting for parameters mean some parameters got no
        gradient in this iteration: an error naming them, unless `find_unused_parameters` is set, in
        which case their (zero) contribution is communicated now.

        `force_all_reduce` (megatron-core's argument): with the distributed optimizer, every rank ends with
        the whole reduced gradient, not just its shard (buckets not launched yet are all-reduced, the others'
        reduced shards all-gathered). Not with ZeRO-2/3, which keep no full gradients.
        """
        if self._grads.finalized:
            return
        if force_all_reduce and self.ddp_config.sharding.gradients:
            raise ValueError(
                f"finish_grad_sync(force_all_reduce=True) with data_parallel_sharding_strategy="
                f"'{self.ddp_config.sharding.name}': ZeRO-2/3 keep only this rank's shard of the reduced "
                f"gradients; use one of {', '.join(map(repr, UNSHARDED_GRADIENT_STRATEGIES))} to get them whole "
                f"on every rank"
            )
        unused_error = None
        if self.ddp_config.overlap_grad_reduce:
            pending = self.grad_sync.pending
            if pending and not self.ddp_config.find_unused_parameters:
                unused_error = unused_parameters_message(self._launch_order, pending, self.param_to_name)
        # Communicate even when about to raise: a peer that saw every gradient is already waiting in
        # these collectives and must not hang.
        self.grad_sync.finish(force_all_reduce)
        if self._find_unused:  # no rank of the group that reduces a parameter got a gradient for it
            expert = [b for b in self._launch_order if b.params_list[0] in self.expert_params]
            dense = [b for b in self._launch_order if b.params_list[0] not in self.expert_params]
            self.unused_params = (globally_unused_params(dense, self.data_parallel_group)
                                  | globally_unused_params(expert, self.expert_data_parallel_group))
        self._grads.finalized = True
        self._grads.unsynchronized = False
        if self.ddp_config.use_distributed_optimizer and self._grads.aliased:
            # gradient_as_bucket_view: only this rank's shard of the buffer is reduced now (NCCL leaves the
            # rest partial): no .grad rather than a .grad that torch's clip_grad_norm_ would read half-reduced.
            for param in self._grad_views:
                param.grad = None
            self._grads.aliased = False
        self.param_sync.end_iteration()  # ZeRO-3: release what the first iteration (or an unused param) kept
        if unused_error:
            raise ValueError(unused_error)
        if self._overlap:
            self.grad_sync.learn_expected_counts()  # the first complete iteration sets what to expect
        raise_if_requires_grad_changed(self._all_named_params)
        if self.ddp_config.check_for_nan_in_grad:
            raise_if_any_rank_found_nonfinite(self.param_and_grad_buffers + self.expert_parallel_buffers,
                                              self.data_parallel_group)

    # ---------------------------------------------------------------- parameter all-gather
    def start_param_sync(self, force_sync: bool = False):
        """All-gather every bucket's updated parameter shards (called by the DistributedOptimizer).

        With overlap_param_gather (unless `force_sync`) nothing is sent yet: the forward pre-hooks dispatch
        and wait for the gathers as forward reaches the buckets (param_gather.py). ZeRO-3: the stale full
        parameters are released, and the units gather the new shards on demand (param_units.py).
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

    def zero_grad_buffer(self):
        """Zero all main_grads and reset bucket state; call at the start of every iteration."""
        raise_if_requires_grad_changed(self._all_named_params)
        self._raise_if_params_moved()
        for param in self.param_to_name:
            param.grad = None  # may alias main_grad after an FP32Optimizer step
            param.grad_added_to_main_grad = False
        for buffer in self.param_and_grad_buffers + self.expert_parallel_buffers:
            buffer.reset()
        self.grad_sync.reset()
        self._grads.finalized = False
        self._grads.unsynchronized = False
        self._grads.aliased = False

    def check_ready_for_step(self):
        """Raise unless every gradient of this iteration's backward passes was synchronized (called by the
        optimizer's step(): stepping on unreduced gradients silently makes the replicas diverge)."""
        self._raise_if_params_moved()
        if self._grads.unsynchronized:
            raise RuntimeError(
                "optimizer.step() after a backward pass whose gradients were not synchronized: call "
                "model.finish_grad_sync() after the last micro-batch's backward and before optimizer.step()"
            )

    def _raise_if_params_moved(self):
        problems = [p for buffer in self.param_and_grad_buffers + self.expert_parallel_buffers
                    for p in buffer.misplaced_params()]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(
                f"parameters changed under DistributedDataParallel since it was wrapped: {shown}. Its buffers are "
                f"laid out once, for the dtype, device and storage the parameters had then: convert the model "
                f"(.to(dtype), .half(), .cuda()) before wrapping it, and load new weights in place "
                f"(model.load_state_dict, or param.data.copy_(...)) instead of assigning param.data."
            )

    def scale_gradients(self, scaling_factor: float):
        """Multiply every main_grad by `scaling_factor`."""
        for buffer in self.param_and_grad_buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

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

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        self.finish_param_sync()  # a pending gather must not overwrite the loaded values later
        with self.full_parameters(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
