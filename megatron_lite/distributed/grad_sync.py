"""The gradient side of DistributedDataParallel: `GradSync`, the object the wrapper holds beside its parameter
synchronization (param_sync.py), and its launch schedule `GradSyncSchedule`.

GradSync registers a hook on every trainable parameter and owns what happens to the gradients from then on
(megatron-core's bucket groups as its DDP drives them; FSDP2's FSDPParamGroup post-backward), each iteration::

    reset()                   (zero_grad_buffer) main_grad := 0, buckets and the schedule forget the last iteration
    backward                  _grad_ready_hook per parameter: .grad -> main_grad (add_), and outside
                              no_sync() with overlap_grad_reduce, mark it ready and launch complete buckets
    finish()                  (finish_grad_sync) launch the rest, wait, then the verdicts (grad_checks.py)
    check_ready_for_step()    the optimizer refuses to step on gradients that were never synchronized

Buckets are launched in the order their gradients are expected in backward, never in the order they happen
to complete (GradSyncSchedule): every rank then issues the same sequence of collectives even when autograd
visits parameters in a rank-dependent order. A complete bucket waits for the earlier ones; finish() launches
what is left (buckets whose parameters got no gradient included) and waits for every bucket. With
find_unused_parameters nothing is launched in backward while another wrapper with overlap_grad_reduce on one
of its process groups lives in the process (GradSyncSchedule's ranks_may_differ).
"""

import contextlib
import functools
import gc
import math
import weakref
from typing import Dict, FrozenSet, List, Tuple

import torch

from .bucket import Bucket
from .distributed_data_parallel_config import UNSHARDED_GRADIENT_STRATEGIES, DistributedDataParallelConfig
from .grad_checks import (
    globally_unused_params,
    raise_if_any_rank_found_nonfinite,
    raise_if_params_replaced,
    raise_if_requires_grad_changed,
    unused_parameters_message,
)
from .model_checks import sparse_grad_error
from .param_and_grad_buffer import ParamAndGradBuffer
from .param_sync import ParamSync

ZERO2_BUCKETS_IN_FLIGHT = 2
"""ZeRO-2 with overlap: launched buckets whose full gradients may still exist (an older one is then waited for)."""

ZERO3_BUCKETS_IN_FLIGHT = 1
"""ZeRO-3: one launched bucket at a time, FSDP2's rule (a unit's reduce-scatter is waited for when the next one is
issued, a unit's backward later): each one in flight holds a unit's full gradients and, at dp > 2 on gloo, a
unit-sized scratch (collectives.py), which at ZeRO-3's 16/d bytes per parameter is what the window costs."""


class GradSync:
    """The gradient synchronization of a DistributedDataParallel: its grad-ready hooks, their per-iteration state
    and the calls of the protocol around them (see the module docstring). The wrapper holds one (`grad_sync`) and
    delegates megatron-core's calls to it (zero_grad_buffer, no_sync, start/finish_grad_sync, scale_gradients).

    Args:
        module: the wrapped model (checked for parameters replaced since wrapping).
        config: the wrapper's DistributedDataParallelConfig.
        buffers: every ParamAndGradBuffer, dense ones first, then expert ones (hooks are registered in this order).
        param_to_bucket: each trainable parameter's bucket.
        param_to_name: each trainable parameter's name, in the model's registration order.
        named_params: (name, param, requires_grad at wrap time) for every parameter, frozen ones too: a later
            change is an error.
        expert_params: the parameters reduced over `expert_data_parallel_group` (expert_parallel.py).
        launch_order: every bucket in the order its collective is launched (launch_order()).
        param_sync: the parameter synchronization (ZeRO-3 releases a unit once its gradients arrived).
        data_parallel_group, expert_data_parallel_group: the groups the dense and the expert gradients are
            reduced over (find_unused_parameters' and check_for_nan_in_grad's all-reduces run on them).
    """

    def __init__(self, module: torch.nn.Module, config: DistributedDataParallelConfig,
                 buffers: List[ParamAndGradBuffer], param_to_bucket: Dict[torch.nn.Parameter, Bucket],
                 param_to_name: Dict[torch.nn.Parameter, str],
                 named_params: List[Tuple[str, torch.nn.Parameter, bool]], expert_params: FrozenSet[torch.nn.Parameter],
                 launch_order: List[Bucket], param_sync: ParamSync, data_parallel_group, expert_data_parallel_group):
        self.module = module
        self.config = config
        self.buffers = buffers
        self.param_to_name = param_to_name
        self.named_params = named_params
        self.expert_params = expert_params
        self.param_sync = param_sync
        self.data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group
        self.launch_order = launch_order
        self.schedule = GradSyncSchedule(launch_order, config.sharding.gradients, config.sharding.parameters,
                                         config.find_unused_parameters, config.overlap_grad_reduce)
        # megatron-core's bucket-group flag: False inside no_sync(), where the hooks only accumulate.
        self.is_last_microbatch = True
        self.unused_params: frozenset = frozenset()  # find_unused_parameters: no rank's gradient in this iteration
        # This iteration's state: whether finish() ran, whether a backward ran since reset() / finish(), whether
        # the gradient views are .grad now. A plain object's attributes: the hooks update them at every gradient.
        self._finalized = False
        self._unsynchronized = False
        self._aliased = False
        # gradient_as_bucket_view: params whose .grad can be main_grad (same dtype, a persistent buffer).
        self._grad_views = [p for p, bucket in param_to_bucket.items() if config.gradient_as_bucket_view
                            and not bucket.shards_grads and p.main_grad.dtype == p.dtype]
        self._overlap = config.overlap_grad_reduce
        self._find_unused = config.find_unused_parameters

        self._hook_handles = []  # remove_hooks()
        for buffer in buffers:
            for bucket in buffer.buckets:
                for index, param in enumerate(bucket.params_list):
                    self._hook_handles.append(param.register_post_accumulate_grad_hook(
                        functools.partial(self._grad_ready_hook, bucket=bucket, index=index)))

    def remove_hooks(self):
        """Unregister the gradient-ready hooks from the parameters (live recovery discards a wrapper after a
        failure: a hook held by a parameter keeps this object, and with it the buckets, the parameter
        synchronization and their process groups, alive out of the garbage collector's sight, and a gloo group
        releases its peers only once freed)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self.schedule.withdraw()  # launches nothing in backward any more

    def _grad_ready_hook(self, param: torch.nn.Parameter, bucket: Bucket, index: int):
        """Runs after autograd accumulated `param.grad` (= bucket.params_list[index]): move it into
        main_grad and, on the last micro-batch with overlap, mark it ready and maybe launch buckets."""
        if self._finalized:
            raise RuntimeError(
                f"gradient for {self.param_to_name[param]} arrived after finish_grad_sync(): call "
                f"zero_grad_buffer() at the start of every iteration"
            )
        self._unsynchronized = True
        if self._find_unused:
            bucket.grad_seen[index] = True
        report_ready = self._overlap and self.is_last_microbatch
        if report_ready:
            bucket.check_accepts_grad(index)  # before touching main_grad: it may be in flight
            self.schedule.before_arrival(bucket)  # ZeRO-2/3: free what a finished collective holds first
        grad = param.grad
        if grad is not None:
            if grad.layout is not torch.strided:
                raise sparse_grad_error(self.param_to_name[param], grad)
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
            self.schedule.launch_ready()
        self.param_sync.grad_arrived(bucket, index)  # ZeRO-3: its backward done, release the full parameters

    # ---------------------------------------------------------------- the protocol (the wrapper's calls)
    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside the context accumulate in main_grad; nothing is communicated."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def begin_forward(self):
        """gradient_as_bucket_view: make .grad the main_grad view again (once per iteration), so that autograd
        accumulates into the buffer itself."""
        if not self._aliased:
            for param in self._grad_views:
                param.grad = param.main_grad
            self._aliased = True

    def start(self):
        """Launch the collectives of all buckets not launched yet (async with overlap_grad_reduce)."""
        self.schedule.launch_rest()

    def finish(self, force_all_reduce: bool = False):
        """DistributedDataParallel.finish_grad_sync (see there): launch what is left, wait for every bucket, then
        the verdicts (unused parameters, parameters frozen or replaced, NaN/Inf on any rank)."""
        if self._finalized:
            return
        config = self.config
        if force_all_reduce and config.sharding.gradients:
            raise ValueError(
                f"finish_grad_sync(force_all_reduce=True) with data_parallel_sharding_strategy="
                f"'{config.sharding.name}': ZeRO-2/3 keep only this rank's shard of the reduced "
                f"gradients; use one of {', '.join(map(repr, UNSHARDED_GRADIENT_STRATEGIES))} to get them whole "
                f"on every rank"
            )
        unused_error = None
        if config.overlap_grad_reduce:
            pending = self.schedule.pending
            if pending and not config.find_unused_parameters:
                unused_error = unused_parameters_message(self.launch_order, pending, self.param_to_name)
        # ZeRO-3: first issue the parameter gathers this rank skipped (a branch it did not run), before blocking
        # on the gradient collectives: a peer may be waiting for one of them in its backward, and only then
        # issue the gradient collectives this rank would wait for.
        self.param_sync.end_backward()
        # Communicate even when about to raise: a peer that saw every gradient is already waiting in
        # these collectives and must not hang.
        self.schedule.finish(force_all_reduce)
        if self._find_unused:  # no rank of the group that reduces a parameter got a gradient for it
            expert = [b for b in self.launch_order if b.params_list[0] in self.expert_params]
            dense = [b for b in self.launch_order if b.params_list[0] not in self.expert_params]
            self.unused_params = (globally_unused_params(dense, self.data_parallel_group)
                                  | globally_unused_params(expert, self.expert_data_parallel_group))
        self._finalized = True
        self._unsynchronized = False
        if config.use_distributed_optimizer and self._aliased:
            # gradient_as_bucket_view: only this rank's shard of the buffer is reduced now (NCCL leaves the
            # rest partial): no .grad rather than a .grad that torch's clip_grad_norm_ would read half-reduced.
            for param in self._grad_views:
                param.grad = None
            self._aliased = False
        self.param_sync.end_iteration()  # ZeRO-3: release what the first iteration (or an unused param) kept
        if unused_error:
            raise_if_params_replaced(self.module, self.named_params)  # the reason, if it is one
            raise ValueError(unused_error)
        if self._overlap:
            self.schedule.learn_expected_counts()  # the first complete iteration sets what to expect
        raise_if_requires_grad_changed(self.named_params)
        if config.check_for_nan_in_grad:
            raise_if_any_rank_found_nonfinite(self.buffers, self.data_parallel_group)

    def reset(self):
        """DistributedDataParallel.zero_grad_buffer: zero all main_grads and forget the last iteration."""
        raise_if_params_replaced(self.module, self.named_params)
        raise_if_requires_grad_changed(self.named_params)
        self._raise_if_params_moved()
        for param in self.param_to_name:
            param.grad = None  # may alias main_grad after an FP32Optimizer step
            param.grad_added_to_main_grad = False
        for buffer in self.buffers:
            buffer.reset()
        self.schedule.reset()
        self._finalized = False
        self._unsynchronized = False
        self._aliased = False

    def check_ready_for_step(self):
        """Raise unless every gradient of this iteration's backward passes was synchronized (called by the
        optimizer's step(): stepping on unreduced gradients silently makes the replicas diverge)."""
        self._raise_if_params_moved()
        if self._unsynchronized:
            raise RuntimeError(
                "optimizer.step() after a backward pass whose gradients were not synchronized: call "
                "model.finish_grad_sync() after the last micro-batch's backward and before optimizer.step()"
            )

    def _raise_if_params_moved(self):
        problems = [p for buffer in self.buffers for p in buffer.misplaced_params()]
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
        for buffer in self.buffers:
            buffer.scale_gradients(scaling_factor)


def launch_order(buckets: List[Bucket], params: List[torch.nn.Parameter]) -> List[Bucket]:
    """`buckets` in the order their collectives are launched: by when a bucket's last gradient is expected,
    its earliest-registered parameter (in `params`, the model's registration order) arriving last in backward.
    Within one buffer this is simply bucket order. Dense and expert buckets interleave, by rank if expert groups
    hold different experts: deadlock-free all the same, as every rank issues the dense buckets in one order and
    every rank of an expert group its buckets in one. Parameters are gathered in its reverse (param_sync.py)."""
    registration = {p: i for i, p in enumerate(params)}
    return sorted(buckets, key=lambda b: -min(registration[p] for p in b.params_list))


_LAUNCHING_IN_BACKWARD = weakref.WeakSet()
"""The GradSyncSchedule of every live wrapper in this process with overlap_grad_reduce (each may launch gradient
collectives, and under ZeRO-3 gather parameters, during backward): find_unused_parameters launches in backward
only while no other one reduces over one of its process groups (GradSyncSchedule's ranks_may_differ)."""


class GradSyncSchedule:
    """When each bucket's gradient collective is launched and finished (GradSync's part).

    Args:
        order: every bucket of the wrapper (dense and expert buffers), in launch order (launch_order()).
        shards_grads: whether buckets free their full-size gradients once reduced (ZeRO-2/3): then at most
            ZERO2_BUCKETS_IN_FLIGHT launched buckets keep them while backward goes on.
        shards_params: ZeRO-3: ZERO3_BUCKETS_IN_FLIGHT instead.
        ranks_may_differ: find_unused_parameters, where ranks may run different branches. A bucket then
            completes in backward only on the ranks that ran all its parameters, so its collective comes at a
            rank-dependent point. Harmless while this wrapper is the only one that issues collectives on its
            groups in backward: its launches keep their order. Under ZeRO-3 no rank then waits for a gradient
            collective during backward (only completed ones are finished there): a peer that skipped the
            bucket's unit launches it in finish_grad_sync only, and may be waiting in its own backward for a
            parameter gather this rank issues only there too; the in-flight bound is lost. With another live
            overlap_grad_reduce wrapper on one of its process groups (model chunks) a rank whose bucket waits
            would issue the other wrapper's collectives before it, a peer after it, and both would wait forever:
            nothing is then launched during backward, every bucket waits for finish_grad_sync (no overlap, no
            in-flight bound; torch DDP instead marks a rank's unused parameters ready at the start of backward,
            from a traversal of the forward's graph). Decided before each backward's first launch, from
            _LAUNCHING_IN_BACKWARD after a garbage collection (a wrapper dropped but not yet collected would
            count on some ranks only; one whose hooks are not removed stays alive, and counts, on all), and for
            good once another one was seen: every rank builds the same wrappers and groups, so every rank
            decides alike. Wrappers on distinct group objects over the same ranks are not seen: that is
            the caller's to avoid (one data-parallel group for all chunks, as megatron-core's parallel_state
            gives).
        overlap: overlap_grad_reduce: the schedule joins _LAUNCHING_IN_BACKWARD until withdraw().
    """

    def __init__(self, order: List[Bucket], shards_grads: bool, shards_params: bool = False,
                 ranks_may_differ: bool = False, overlap: bool = False):
        self.order = order
        # Without gradient sharding no bound: the full-size buffer persists anyway.
        self.window = ZERO3_BUCKETS_IN_FLIGHT if shards_params else ZERO2_BUCKETS_IN_FLIGHT if shards_grads \
            else math.inf
        self.shards_params = shards_params
        self.ranks_may_differ = ranks_may_differ
        self.wait_in_backward = not (shards_params and ranks_may_differ)
        self.beside_others = False  # ranks_may_differ beside another wrapper: launch nothing in backward
        self.next = 0  # the next bucket to launch, in order
        self.oldest = 0  # the first launched bucket that may not be finished yet
        # The process groups its collectives run on (a bucket keeps its groups alive, so the ids are theirs).
        world = torch.distributed.group.WORLD
        self.groups = {id(world if b.data_parallel_group is None else b.data_parallel_group) for b in order}
        self.groups |= {id(b.inter_instance_group) for b in order if b.inter_instance_group is not None}
        if overlap:
            _LAUNCHING_IN_BACKWARD.add(self)

    def withdraw(self):
        """The wrapper launches nothing in backward any more (its hooks are removed)."""
        _LAUNCHING_IN_BACKWARD.discard(self)

    def launches_in_backward(self) -> bool:
        """Whether complete buckets are launched during backward (see ranks_may_differ)."""
        if self.ranks_may_differ and not self.beside_others and self._others():
            gc.collect()  # only live wrappers count, on every rank alike
            self.beside_others = self._others()
        return not self.beside_others

    def _others(self) -> bool:
        """Whether another schedule in _LAUNCHING_IN_BACKWARD shares one of this one's process groups."""
        return any(other is not self and not other.groups.isdisjoint(self.groups)
                   for other in list(_LAUNCHING_IN_BACKWARD))

    @property
    def pending(self) -> List[Bucket]:
        """The buckets not launched yet, in order."""
        return self.order[self.next:]

    def reset(self):
        """A new iteration: nothing launched."""
        self.next = self.oldest = 0

    def launch_ready(self):
        """Launch complete buckets, strictly in order (a complete bucket waits for earlier ones); nothing with
        ranks_may_differ beside another wrapper (see the class)."""
        if self.next == 0 and not self.launches_in_backward():
            return
        order = self.order
        while self.next < len(order) and order[self.next].is_ready():
            if self.next >= self.window and self.wait_in_backward:
                # ZeRO-2/3: bound the full-size gradients in flight; the oldest bucket's shard is kept and
                # its full gradients (and collective scratch) freed before the next launch allocates its own.
                order[self.next - self.window].finish_grad_sync()
            order[self.next].start_grad_sync()
            self.next += 1

    def before_arrival(self, bucket: Bucket):
        """A gradient of `bucket` is about to be added in (ZeRO-2/3; called at every arrival): finish the
        launched buckets whose collective is already done, oldest first, so that their full gradients and
        scratch go now rather than at the next launch. ZeRO-3, where `bucket`'s storage is about to grow (the
        next unit's first gradient): finish them all, waiting, first (FSDP2's rule: one unit's full gradients
        at a time; the collective overlaps the backward up to that first gradient). A bucket whose finish
        would run a collective of its own (the inter-instance all-reduce) is left to the launch order, so that
        no rank issues it at a time of its own."""
        if self.window == math.inf:  # nothing is freed without gradient sharding
            return
        wait = self.shards_params and self.wait_in_backward and not bucket.grad_storage_allocated()
        while self.oldest < self.next:  # (a bucket finished already counts as completed: a no-op)
            launched = self.order[self.oldest]
            handle = launched.communication_handle
            if launched.inter_instance_group is not None or handle is None:
                return
            if not (wait or handle.is_completed()):
                return
            launched.finish_grad_sync()
            self.oldest += 1

    def launch_rest(self, force_all_reduce: bool = False):
        """Launch every bucket not launched yet, in order."""
        for bucket in self.order[self.next:]:
            bucket.start_grad_sync(force_all_reduce)
        self.next = len(self.order)

    def finish(self, force_all_reduce: bool = False):
        """Launch what is left, then wait for every bucket."""
        self.launch_rest(force_all_reduce)
        for bucket in self.order:
            bucket.finish_grad_sync(force_all_reduce)

    def learn_expected_counts(self):
        """After the first complete iteration: what each bucket is to expect from now on."""
        for bucket in self.order:
            if bucket.expected_counts is None:
                bucket.learn_expected_counts()
