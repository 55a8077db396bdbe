"""Contiguous parameter/gradient storage cut into buckets (the buckets themselves: bucket.py), and what of it
this rank owns: its shard of every bucket and, parameter by parameter, the ShardRanges a distributed optimizer
updates (shard_ranges), gathered back into full buffers by gather_full_buffers.

::

    grad_data  |  p3.main_grad  | p2.main_grad |  p1.main_grad  | p0.main_grad | pad |
               |<------ bucket 0 ------------->|<------------ bucket 1 ------------>|
               |<- shard r=0 ->|<- shard r=1 ->|<---- shard 0 ---->|<--- shard 1 --->|  (dist. optimizer)

`param.main_grad` is a view into `grad_data` (only ever updated in place, never reassigned); with the
distributed optimizer `param.data` is a view into `param_data` as well, so the optimizer can write a
rank's shard of updated parameters straight into the buffer and all-gather it. With ZeRO-2 (ZeRO-3)
there is no contiguous grad_data (param_data): each bucket's storage is its own, so that it can be freed
on its own; the layout, and so every offset, is the same.

Exception (param_name_patterns_for_fp32_local_accumulation): a matched low-precision parameter's main_grad
is a tensor of its own, in fp32, where its gradients accumulate; its slice of grad_data is only the
communication copy, filled from main_grad when the bucket is launched and copied back when it is reduced.

Which elements a rank owns is the layout's answer (layout.BufferLayout.owned_ranges, BucketLayout.shard),
asked with the size of the group the buffer shards over and this rank's place in it (with R
distributed-optimizer instances: the instance's m ranks, i.e. its position; see layout.DataParallelTopology).
"""

from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import collectives
from .bucket import Bucket
from .distributed_data_parallel_config import DistributedDataParallelConfig, pattern_matches
from .layout import OwnedRange, compute_buffer_layout

__all__ = ["Bucket", "ParamAndGradBuffer", "ShardRange", "gather_full_buffers", "shard_ranges"]


class ParamAndGradBuffer:
    """All trainable parameters of one (param dtype, grad dtype) pair in one contiguous buffer.

    Args:
        ddp_config: the wrapper's configuration.
        param_dtype, grad_dtype: dtypes of the parameters and of main_grad / grad_data.
        params: the parameters, in registration order (laid out in reverse).
        data_parallel_group: the group the buckets are reduced (and, sharded, split and gathered) over: the
            whole data-parallel group, or this rank's distributed-optimizer instance.
        bucket_size: elements per bucket, or None for one bucket.
        param_to_name: names used in error messages.
        gradient_scaling_factor: applied to each bucket before its collective.
        unit_of: ZeRO-3: each parameter's unit of gathering (a bucket never spans two units).
        inter_instance_group: with several distributed-optimizer instances, the ranks holding the same
            shards in the other instances (each reduced shard is all-reduced over it); else None.
        fp32_local_accumulation: parameters whose main_grad is a separate fp32 tensor (see the module
            docstring); ignored where grad_dtype is fp32 already.
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        data_parallel_group,
        bucket_size: Optional[int],
        param_to_name: Dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        unit_of: Optional[Dict[torch.nn.Parameter, int]] = None,
        inter_instance_group=None,
        fp32_local_accumulation: AbstractSet[torch.nn.Parameter] = frozenset(),
    ):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = list(params)
        self.data_parallel_group = data_parallel_group
        self.inter_instance_group = inter_instance_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.data_parallel_rank = dist.get_rank(data_parallel_group)

        devices = {p.device for p in self.params}
        if len(devices) != 1:
            names = {str(p.device): param_to_name.get(p, "?") for p in self.params}
            raise ValueError(f"all parameters must be on one device before wrapping, found {names}")
        device = devices.pop()

        layout = compute_buffer_layout(
            [p.numel() for p in self.params],
            bucket_size=bucket_size,
            data_parallel_world_size=self.data_parallel_world_size,
            use_distributed_optimizer=ddp_config.use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
            shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in self.params],
            unit_ids=None if unit_of is None else [unit_of[p] for p in self.params],
        )
        self.layout = layout
        self.numel = layout.numel
        self.numel_unpadded = layout.numel_unpadded

        # Padding stays zero forever: main_grad views never cover it and the collectives only sum zeros.
        # ZeRO-2: no contiguous grad_data; each bucket's gradients have a storage of their own, freed
        # between iterations (see Bucket). ZeRO-2/3's per-bucket storages are allocated one bucket at a time,
        # just before its Bucket (which releases them): building never holds more than one full bucket.
        self.device = device
        self.shards_grads = ddp_config.sharding.gradients
        shards_params = ddp_config.sharding.parameters
        self.grad_data = None if self.shards_grads else torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if ddp_config.use_distributed_optimizer and not shards_params:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)

        self.param_index_map = dict(zip(self.params, layout.param_ranges))  # registration order
        self._shapes = {param: tuple(param.shape) for param in self.params}
        self._param_to_name = param_to_name
        self.buckets = []
        # What this rank owns, decided by the layout: its shard of every bucket and each parameter's part of it
        # (in buffer order; none without the distributed optimizer, where nothing is sharded).
        self.owned_ranges: Tuple[OwnedRange, ...] = ()
        if ddp_config.use_distributed_optimizer:
            self.owned_ranges = layout.owned_ranges(self.data_parallel_world_size, self.data_parallel_rank)
        owned = {r.param_index: r for r in self.owned_ranges}  # a parameter lies in one bucket: one part at most
        for bucket_id, b in enumerate(layout.buckets):
            # ZeRO-2/3's full-size storages are released by the Bucket before anything reads them (grown back
            # zeroed, or gathered): empty, so that building never touches their pages.
            grad_data = torch.empty(b.numel, dtype=grad_dtype, device=device) if self.shards_grads \
                else self.grad_data[b.start:b.end]
            param_data = None
            if ddp_config.use_distributed_optimizer:
                param_data = torch.empty(b.numel, dtype=param_dtype, device=device) if shards_params \
                    else self.param_data[b.start:b.end]
            # This rank's shard of the bucket, in bucket coordinates (none without the distributed optimizer).
            shard = (0, 0)
            if ddp_config.use_distributed_optimizer:
                low, high = b.shard(self.data_parallel_world_size, self.data_parallel_rank)
                shard = (low - b.start, high - b.start)
            # ZeRO-3: only this rank's shard of param_data is written (zeros, then the parameters' values that
            # fall in it): the Bucket keeps that part as its param_shard and releases the rest unread.
            if shards_params:
                param_data[shard[0]:shard[1]].zero_()
            extra_main_grads = {}  # param -> its slice of grad_data
            for index in b.param_indices:
                param = self.params[index]
                start, end, _ = layout.param_ranges[index]
                if param_data is not None:
                    view = param_data[start - b.start:end - b.start].view(param.shape)
                    if not shards_params:
                        view.copy_(param.data)
                    elif index in owned:  # (a meta build's stride-0 placeholder flattens without a copy)
                        part = owned[index]
                        param_data[part.buffer_start - b.start:part.buffer_end - b.start].copy_(
                            param.data.reshape(-1)[part.param_start:part.param_end])
                    param.data = view
                param.main_grad = grad_data[start - b.start:end - b.start].view(param.shape)
                if param in fp32_local_accumulation and grad_dtype != torch.float32:
                    # megatron-core's "extra main_grad": accumulate here in fp32, communicate the buffer slice.
                    extra_main_grads[param] = param.main_grad
                    param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=device)
            self.buckets.append(
                Bucket(
                    ddp_config=ddp_config,
                    params=[self.params[i] for i in b.param_indices],
                    param_data=param_data,
                    grad_data=grad_data,
                    offset=b.start,
                    shard=shard,
                    numel_unpadded=b.numel_unpadded,
                    data_parallel_group=data_parallel_group,
                    gradient_scaling_factor=gradient_scaling_factor,
                    bucket_id=bucket_id,
                    param_to_name=param_to_name,
                    inter_instance_group=inter_instance_group,
                    extra_main_grads=extra_main_grads,
                )
            )
        self.param_to_bucket = {p: bucket for bucket in self.buckets for p in bucket.params_list}
        for param, (start, end, bucket_id) in self.param_index_map.items():
            bucket = self.buckets[bucket_id]
            bucket.param_to_index[param] = (start - bucket.offset, end - bucket.offset)
        for index, part in owned.items():
            self.buckets[part.bucket_id].param_to_owned_range[self.params[index]] = part

    def shard_ranges(self) -> List["ShardRange"]:
        """The parts of this buffer's parameters that this rank owns, in buffer order (self.owned_ranges, with
        their tensors)."""
        return [ShardRange(self.params[r.param_index], self, r.buffer_start, r.buffer_end, r.param_start, r.param_end,
                           self.buckets[r.bucket_id], r.shard_start)
                for r in self.owned_ranges]

    def misplaced_params(self) -> List[str]:
        """Parameters that no longer are what the buffer was built around: another dtype, device or shape
        (`model.to(torch.bfloat16)` or `.cuda()` after wrapping), or, where param.data is a view into the
        parameter buffer (distributed optimizer), data that is not that view any more (`param.data = ...`).
        Either way the optimizer would step, or the all-gather overwrite, something the model does not use."""
        problems = []
        for param, (start, _, bucket_id) in self.param_index_map.items():
            name = self._param_to_name.get(param, f"<parameter of shape {self._shapes[param]}>")
            moved = param.dtype != self.param_dtype or param.device != self.device
            if moved or tuple(param.shape) != self._shapes[param]:
                problems.append(f"{name} is {param.dtype} {tuple(param.shape)} on {param.device}, wrapped as "
                                f"{self.param_dtype} {self._shapes[param]} on {self.device}")
                continue
            bucket = self.buckets[bucket_id]
            expected = bucket.expected_param_data_ptr(start - bucket.offset)
            # (an empty tensor's data_ptr() is 0 wherever it points: nothing to misplace)
            if expected is not None and param.numel() and param.data_ptr() != expected:
                problems.append(f"{name}: param.data is not its view into the parameter buffer any more")
        return problems

    def scale_gradients(self, scaling_factor: float):
        """Multiply all gradients in the buffer by `scaling_factor` (in place; ZeRO-2: the reduced shards), and
        the separate fp32 main_grads (as megatron-core)."""
        for bucket in self.buckets:
            for param in bucket.extra_main_grads:
                param.main_grad.mul_(scaling_factor)
        if self.shards_grads:
            for bucket in self.buckets:
                bucket.reduced_grad_shard.mul_(scaling_factor)
        else:
            self.grad_data.mul_(scaling_factor)

    def reset(self):
        """Zero the gradients and forget the buckets' progress; start of an iteration."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()


@dataclass
class ShardRange:
    """The part of one model parameter that this rank owns (layout.OwnedRange, with its tensors)."""

    model_param: torch.nn.Parameter
    buffer: ParamAndGradBuffer
    buffer_start: int  # [buffer_start, buffer_end) in buffer coordinates
    buffer_end: int
    param_start: int  # the same range in the flattened parameter
    param_end: int
    bucket: Bucket
    shard_start: int  # the same range in the bucket's reduced_grad_shard

    @property
    def params(self) -> torch.Tensor:
        """This rank's part of the model parameters of the range (what the optimizer updates)."""
        return self.bucket.own_params[self.shard_start:self.shard_start + self.buffer_end - self.buffer_start]

    @property
    def grad(self) -> torch.Tensor:
        """This rank's reduced gradient of the range (after finish_grad_sync)."""
        return self.bucket.reduced_grad_shard[self.shard_start:self.shard_start + self.buffer_end - self.buffer_start]


def _buffers(model_chunks) -> List[ParamAndGradBuffer]:
    """Every buffer of the DistributedDataParallel chunks, the dense ones of each chunk before its experts'."""
    return [buffer for chunk in model_chunks for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers]


def shard_ranges(model_chunks) -> List[ShardRange]:
    """The owned ranges of every parameter of this rank (a rank owns what its data-parallel position owns,
    see layout.DataParallelTopology), in buffer order. Expert buffers (sharded over the expert data-parallel
    group) follow the dense ones."""
    return [r for buffer in _buffers(model_chunks) for r in buffer.shard_ranges()]


def gather_full_buffers(model_chunks, ranges: Sequence[ShardRange],
                        values: Sequence[Optional[torch.Tensor]]) -> Dict[int, torch.Tensor]:
    """For every buffer of `model_chunks` (by id), a full fp32 flat tensor assembled from every rank's `values`
    (one per range of `ranges`, this rank's shard_ranges(model_chunks); None: zeros): one all-gather per
    bucket over the buffer's group, so every element crosses the network once. Collective."""
    buffers = _buffers(model_chunks)
    flats = {id(buffer): torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.device) for buffer in buffers}
    for s, value in zip(ranges, values):
        if value is not None:
            flats[id(s.buffer)][s.buffer_start:s.buffer_end].copy_(value)
    for buffer in buffers:
        for bucket in buffer.layout.buckets:
            collectives.all_gather(flats[id(buffer)][bucket.start:bucket.end], group=buffer.data_parallel_group)
    return flats


def fp32_local_accumulation_params(named_params, config: DistributedDataParallelConfig, group=None) -> frozenset:
    """The trainable parameters of `named_params` ((name, param) pairs) whose names match
    `config.param_name_patterns_for_fp32_local_accumulation`. A pattern that matches no trainable parameter
    on any rank of `group` (a typo would silently turn the feature off) raises ValueError on every rank;
    ranks may match different parameters (expert parameters named per rank). One small collective, only
    when patterns are given."""
    patterns = config.param_name_patterns_for_fp32_local_accumulation
    if not patterns:
        return frozenset()
    trainable = [(name, p) for name, p in named_params if p.requires_grad]
    hits = [pattern for pattern in patterns if any(pattern_matches(pattern, name) for name, _ in trainable)]
    hit_anywhere = set().union(*collectives.all_gather_object(hits, group))
    unmatched = [pattern for pattern in patterns if pattern not in hit_anywhere]
    if unmatched:
        raise ValueError(f"param_name_patterns_for_fp32_local_accumulation: {unmatched} match no trainable "
                         f"parameter (fnmatch on names such as {[name for name, _ in trainable[:3]]}); fix "
                         f"or drop them")
    return frozenset(p for name, p in trainable if config.accumulates_in_fp32(name))
