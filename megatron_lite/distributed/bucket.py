"""A bucket: a contiguous run of parameters whose gradients one collective reduces, and, with the
distributed optimizer, whose parameters one collective gathers.

Per iteration a bucket counts its parameters' gradient arrivals, launches its all-reduce or
reduce-scatter when complete (in the fixed order DistributedDataParallel keeps), and is waited for in
finish_grad_sync. With ZeRO-2/3 it also owns the lifecycle of its full-size storages: gradients grown on
the first arrival and freed after the reduction (the rank's reduced shard persists), parameters gathered
before use and released after it (the rank's parameter shard persists).
"""

import math
from typing import Dict, List, Optional, Tuple

import torch

from . import collectives
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .layout import OwnedRange
from .storage import ReleasableStorage


class Bucket:
    """A contiguous run of parameters whose gradients are communicated by one collective.

    Args:
        ddp_config: the wrapper's configuration.
        params: the bucket's parameters, in buffer order.
        param_data: the bucket's slice of the parameter buffer (None without the distributed optimizer).
        grad_data: the bucket's slice of the gradient buffer.
        offset: index of the bucket's first element in the whole buffer.
        shard: elements [lo, hi) of the bucket that this rank owns (its shard, decided by the layout:
            layout.BucketLayout.shard); (0, 0) without the distributed optimizer.
        numel_unpadded: elements up to the end of the last parameter.
        data_parallel_group: the group to reduce over.
        gradient_scaling_factor: applied to grad_data before the collective (1/dp unless averaging in it).
        bucket_id: index of the bucket in its buffer (used in error messages).
        param_to_name: parameter names for error messages.
        inter_instance_group: the same shard's holders in the other distributed-optimizer instances: the
            reduce-scattered shard is all-reduced over it. None with one instance.
        extra_main_grads: parameters whose main_grad is a separate fp32 tensor
            (param_name_patterns_for_fp32_local_accumulation), each with its slice of grad_data: that slice
            is filled from main_grad when the bucket is launched, and copied back when it is reduced.
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        params: List[torch.nn.Parameter],
        param_data: Optional[torch.Tensor],
        grad_data: torch.Tensor,
        offset: int,
        shard: Tuple[int, int],
        numel_unpadded: int,
        data_parallel_group,
        gradient_scaling_factor: float,
        bucket_id: int = 0,
        param_to_name: Optional[Dict[torch.nn.Parameter, str]] = None,
        inter_instance_group=None,
        extra_main_grads: Optional[Dict[torch.nn.Parameter, torch.Tensor]] = None,
    ):
        self.ddp_config = ddp_config
        self.params_list = params
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.data_parallel_group = data_parallel_group
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_name = param_to_name or {}
        self.inter_instance_group = inter_instance_group
        self.extra_main_grads = extra_main_grads or {}  # param -> its slice of grad_data (fp32 main_grad apart)
        self.param_gather_handle = None
        # megatron-core's map: parameter -> its (start, end) elements within the bucket.
        self.param_to_index: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        # The part of each parameter in this rank's shard (layout.OwnedRange; a parameter with none is absent),
        # filled by the buffer like param_to_index: ZeRO-3 writes a meta-built parameter's initial value there.
        self.param_to_owned_range: Dict[torch.nn.Parameter, OwnedRange] = {}
        # ZeRO-2 (sharding.gradients): grad_data has a storage of its own, grown when the first gradient
        # arrives and freed once its reduce-scatter is done; this rank's reduced shard, grad_shard, has one
        # too, grown by the first reduction of an iteration and freed by the next reset (zero_grad_buffer):
        # it lives from finish_grad_sync to the optimizer's step, never before the first backward (FSDP2's
        # sharded .grad, set to None by zero_grad, is alive for the same span).
        self.shards_grads = ddp_config.sharding.gradients
        self.shards_params = ddp_config.sharding.parameters
        # This rank's shard, inside the bucket (the layout's: one of the equal shards of the group, this rank's
        # distributed-optimizer instance or expert group; none without the distributed optimizer).
        self.shard_offset, self.shard_size = shard[0], shard[1] - shard[0]
        self.grad_shard = None
        if self.shards_grads:  # released at once by reset() below: torch.empty's pages are never touched
            self.grad_shard = torch.empty(self.shard_size, dtype=grad_data.dtype, device=grad_data.device)
            self._grad_shard_storage = ReleasableStorage(self.grad_shard)
        self._grad_storage = ReleasableStorage(grad_data)
        self._finished = False
        if self.shards_grads:
            self._grad_storage.release()
        # ZeRO-3: param_data, too, has a storage of its own, holding the full parameters only between
        # start_param_sync() and release_params(); param_shard is this rank's part, which the optimizer updates.
        self.param_shard = None
        self._param_storage = None if param_data is None else ReleasableStorage(param_data)
        self.params_gathered = True
        self._pass_counts = [0] * len(params)  # arrivals in the current backward pass (ZeRO-3 release)
        if self.shards_params:
            base = param_data.data_ptr()
            size = param_data.element_size()
            # Where each parameter lives in param_data, to point it there again after every gather.
            self._param_views = [((p.data_ptr() - base) // size, tuple(p.shape)) for p in params]
            # A released parameter keeps its shape but holds no memory: NaN everywhere (one element,
            # expanded), so a forward on it produces NaN (caught by the NaN check) and a write fails.
            self._released = torch.full((), float("nan"), dtype=param_data.dtype, device=param_data.device)
            self.param_shard = self.my_shard_of(param_data).clone()
            self.release_params()
        # Gradient arrivals per parameter in one backward, learned in the first iteration (megatron-core's
        # golden counts): more than one when a weight's gradient is accumulated twice, e.g. by reentrant
        # activation checkpointing of a shared weight. None until learned. Until then ZeRO-2/3 (sharded
        # gradients) expect one arrival per parameter, so that the first iteration, too, reduces and frees
        # each bucket (and releases each unit) during backward instead of holding every full-size gradient and
        # gathered unit until finish_grad_sync; the other strategies launch every bucket there.
        self.expected_counts: Optional[List[int]] = None
        self._first_iteration_counts = [1] * len(params) if self.shards_grads else None
        self.reset()

    def my_shard_of(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's part of a bucket-sized tensor (grad_data or param_data): a view."""
        return data[self.shard_offset:self.shard_offset + self.shard_size]

    def reset(self):
        """Forget this iteration's progress (called by zero_grad_buffer)."""
        self._counts = [0] * len(self.params_list)  # arrivals on the last micro-batch, by position
        self.grad_seen = [False] * len(self.params_list)  # a gradient arrived in any micro-batch (find_unused)
        self._num_ready = 0  # parameters whose arrivals reached their expected count
        self.communication_handle = None
        self._finished = False
        self.nonfinite_params: List[str] = []
        for param in self.extra_main_grads:
            param.main_grad.zero_()
        if self.shards_grads:
            self._grad_shard_storage.release()  # zeros until the first reduction (reduced_grad_shard)
            self._grad_storage.release()  # unreduced leftovers of an interrupted iteration, if any

    # ---------------------------------------------------------------- ZeRO-2 gradient storage
    @property
    def reduced_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the bucket's reduced gradients (after finish_grad_sync): a view into
        grad_data (ZeRO-1), or grad_shard (ZeRO-2/3; zeros, grown here, when no reduction ran since the
        last reset)."""
        if self.shards_grads:
            self.ensure_grad_shard()
            return self.grad_shard
        return self.my_shard_of(self.grad_data)

    def ensure_grad_shard(self):
        """ZeRO-2/3: grow grad_shard back (zeroed) if reset() released it; views into it stay valid."""
        if self._grad_shard_storage.regrow():
            self.grad_shard.zero_()

    def ensure_grad_storage(self):
        """ZeRO-2: grow grad_data back (zeroed) before a gradient lands in it; main_grad views stay valid."""
        if self._grad_storage.regrow():
            self.grad_data.zero_()

    def grad_storage_allocated(self) -> bool:
        return self._grad_storage.allocated

    @property
    def params_with_grad(self):
        """The parameters whose gradient has arrived (on the last micro-batch) in this iteration."""
        return {p for p, count in zip(self.params_list, self._counts) if count}

    def params_without_gradients(self) -> List[torch.nn.Parameter]:
        """Parameters with no arrival on this iteration's last micro-batch. (Fewer arrivals than the first
        iteration's, but some, only keep the bucket from launching early: finish_grad_sync launches it with
        every gradient already in main_grad.)"""
        return [p for p, c in zip(self.params_list, self._counts) if c == 0]

    def name(self, param) -> str:
        return self.param_to_name.get(param, f"<unnamed parameter of shape {tuple(param.shape)}>")

    def check_accepts_grad(self, index: int):
        """Raise if the bucket was already launched (params_list[index]'s grad would miss the collective)."""
        if self.communication_handle is not None:
            if self.expected_counts is None:  # ZeRO-2/3's first iteration: one arrival expected
                raise RuntimeError(
                    f"parameter {self.name(self.params_list[index])} received a second gradient in one backward "
                    f"(e.g. a weight shared by reentrant activation-checkpointed segments, two backward passes, or "
                    f"an earlier micro-batch's backward run outside no_sync(): torch DDP reads no_sync() at the "
                    f"forward, megatron_lite at the backward, so put both inside): ZeRO-2/3 (sharded gradients) "
                    f"reduce each bucket once all its parameters got one gradient, from the first iteration on. Use "
                    f"non-reentrant checkpointing (use_reentrant=False) or data_parallel_sharding_strategy 'optim'")
            expected = "?" if self.expected_counts is None else self.expected_counts[index]
            raise RuntimeError(
                f"parameter {self.name(self.params_list[index])} received a second gradient after its bucket "
                f"{self.bucket_id} was launched (arrival {self._counts[index] + 1} in this backward; the first "
                f"iteration saw {expected}). Run backward once per micro-batch, wrap all but the last "
                f"micro-batch in no_sync(), and call zero_grad_buffer() before each iteration."
            )

    def mark_ready(self, index: int) -> bool:
        """Count an arrival of params_list[index]'s gradient (after check_accepts_grad(index)); returns
        whether the bucket is complete. By position, not by parameter: this is the hot path. Until the
        expected counts are learned no bucket completes here (the first iteration launches them all in
        finish_grad_sync), except under ZeRO-2/3, which expect one arrival each until then; a parameter
        expected 0 times never completes its bucket either."""
        count = self._counts[index] = self._counts[index] + 1
        expected = self.expected_counts if self.expected_counts is not None else self._first_iteration_counts
        if expected is None or count != expected[index]:
            return False
        self._num_ready += 1
        return self._num_ready == len(self._counts)

    def learn_expected_counts(self):
        """Take this iteration's arrivals as the number to expect per backward from now on."""
        self.expected_counts = list(self._counts)

    def is_ready(self) -> bool:
        return self._num_ready == len(self._counts)

    @torch.no_grad()
    def start_grad_sync(self, force_all_reduce: bool = False):
        """Scale and launch this bucket's all-reduce (or reduce-scatter, unless `force_all_reduce`); async
        with overlap_grad_reduce."""
        assert self.communication_handle is None, "bucket communication launched twice"
        self.ensure_grad_storage()  # ZeRO-2: a bucket none of whose gradients arrived is all zeros
        for param, sent in self.extra_main_grads.items():
            sent.copy_(param.main_grad)  # the one rounding of the fp32 accumulation (an overflow becomes inf)
        if self.ddp_config.check_for_nan_in_grad and not torch.isfinite(self.grad_data).all():
            # Record, but still communicate: the other ranks are already in (or on their way to) this
            # collective. DistributedDataParallel.finish_grad_sync raises on every rank afterwards.
            self.nonfinite_params = [
                self.name(p) for p in self.params_list
                if not torch.isfinite(self.extra_main_grads.get(p, p.main_grad)).all()
            ]
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        self._all_reduced = force_all_reduce or not self.ddp_config.use_distributed_optimizer
        kwargs = dict(group=self.data_parallel_group, async_op=self.ddp_config.overlap_grad_reduce)
        op = collectives.reduce_op(self.ddp_config.average_in_collective)
        if self._all_reduced:
            self.communication_handle = collectives.all_reduce(self.grad_data, op=op, **kwargs)
        elif self.ddp_config.reduce_scatter_with_fp32_accumulation:  # SUM only (the config checks)
            self.communication_handle = collectives.reduce_scatter_with_fp32_accumulation(self.grad_data, **kwargs)
        else:
            self.communication_handle = collectives.reduce_scatter(self.grad_data, op=op, **kwargs)

    def finish_grad_sync(self, force_all_reduce: bool = False):
        """Wait for the bucket's collective (launching it first if it has not been). ZeRO-2: then keep
        this rank's reduced shard (accumulated into grad_shard) and free the full-size gradients. With
        `force_all_reduce`, a bucket that was reduce-scattered gets every rank's reduced shard as well."""
        if self._finished:
            return
        if self.communication_handle is None:
            self.start_grad_sync(force_all_reduce)
        self.communication_handle.wait()
        if self.inter_instance_group is not None:
            # Second level: the instance's reduced shard, summed with the other instances' (one collective
            # over R ranks; every replica ends with bitwise the same values). Here, not in
            # start_grad_sync: it needs the reduce-scatter's result, and gloo orders nothing across groups.
            collectives.all_reduce(self.my_shard_of(self.grad_data), self.inter_instance_group,
                                   op=collectives.reduce_op(self.ddp_config.average_in_collective))
        if force_all_reduce and (not self._all_reduced or self.inter_instance_group is not None):
            collectives.all_gather(self.grad_data, group=self.data_parallel_group)  # every rank's final shard
        for param, sent in self.extra_main_grads.items():
            # The reduced values, exactly, in fp32 (sharded: in this rank's shard only, like the buffer). The
            # full-parameter optimizers read main_grad; the distributed one this bucket's reduced shard.
            param.main_grad.copy_(sent)
        self._finished = True
        if self.shards_grads:
            with torch.no_grad():
                self.reduced_grad_shard.add_(self.my_shard_of(self.grad_data))
            self._grad_storage.release()

    # ---------------------------------------------------------------- ZeRO-3 parameter storage
    @property
    def own_params(self) -> torch.Tensor:
        """This rank's shard of the bucket's parameters, the distributed optimizer's to update: a view into
        param_data (ZeRO-1/2), or the persistent param_shard (ZeRO-3)."""
        if self.shards_params:
            return self.param_shard
        return self.my_shard_of(self.param_data)

    @torch.no_grad()
    def start_param_sync(self, async_op: bool = True, group=None):
        """All-gather param_data, every rank's shard r from rank r, on `group` (default: the bucket's
        data-parallel group): the distributed optimizer's gather of the updated shards, or ZeRO-3's gather of
        a released bucket (param_data grown back and this rank's param_shard put in first). Waited for by
        finish_param_sync (ZeRO-3: wait_params)."""
        assert self.param_data is not None and self.param_gather_handle is None, "parameter gather issued twice"
        group = group or self.data_parallel_group
        if self.param_shard is None:  # the optimizer wrote this rank's shard into param_data in place
            self.param_gather_handle = collectives.all_gather(self.param_data, group=group, async_op=async_op)
            return
        # ZeRO-3. Autograd may hold these parameters for backward: the in-place writes must not bump their
        # version counter (the values are the ones the forward used).
        with torch.autograd._unsafe_preserve_version_counter(self.param_data):
            self._param_storage.regrow()
            self.my_shard_of(self.param_data).copy_(self.param_shard)
            self.param_gather_handle = collectives.all_gather(self.param_data, group=group, async_op=async_op)

    def finish_param_sync(self):
        """Wait for this bucket's parameter all-gather, if one is in flight."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def wait_params(self):
        """ZeRO-3: wait for this bucket's gather; afterwards every param.data is its view into param_data.
        (Autograd's saved references to the parameters see the same values the forward used.)"""
        if self.params_gathered:
            return
        self.finish_param_sync()
        for param, (start, shape) in zip(self.params_list, self._param_views):
            param.data = self.param_data[start:start + math.prod(shape)].view(shape)
        self.params_gathered = True

    def release_params(self):
        """ZeRO-3: free the full parameters; each param.data becomes a shape-keeping NaN placeholder."""
        self.finish_param_sync()
        for param, (_, shape) in zip(self.params_list, self._param_views):
            param.data = self._released.expand(shape)
        self._param_storage.release()
        self.params_gathered = False
        self._pass_counts = [0] * len(self._pass_counts)

    def expected_param_data_ptr(self, start: int) -> Optional[int]:
        """Where the parameter starting at element `start` of the bucket must have its data: in param_data
        (distributed optimizer; ZeRO-3 while gathered), the released placeholder (ZeRO-3 between gathers),
        or None where the parameter keeps its own storage (plain DDP)."""
        if self.param_data is None:
            return None
        if self.shards_params and not self.params_gathered:
            return self._released.data_ptr()
        return self.param_data.data_ptr() + start * self.param_data.element_size()

    def count_backward_arrival(self, index: int) -> bool:
        """ZeRO-3: count one arrival of params_list[index]'s gradient in this backward pass; returns
        whether every parameter of the bucket got all its expected gradients (its backward is done). A
        parameter expected 0 times (unused in the first iteration, find_unused_parameters) that does get a
        gradient now counts as expected once: its unit's other parameters may still need the full values."""
        self._pass_counts[index] += 1
        expected = self.expected_counts if self.expected_counts is not None else self._first_iteration_counts
        return expected is not None and all(c >= max(e, 1) for c, e in zip(self._pass_counts, expected))
