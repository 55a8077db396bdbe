"""The gradient side of DistributedDataParallel: the grad-ready hooks and the protocol around them.

A mixin of the wrapper: distributed_data_parallel.py builds the buffers and buckets, this module registers a
hook on every parameter and owns what happens to the gradients from then on, each iteration::

    zero_grad_buffer()        main_grad := 0, buckets and the schedule forget the last iteration
    backward                  _grad_ready_hook per parameter: .grad -> main_grad (add_), and outside
                              no_sync() with overlap_grad_reduce, mark it ready and launch complete buckets
    finish_grad_sync()        launch the rest, wait (grad_sync.py), then the verdicts (grad_checks.py)
    check_ready_for_step()    the optimizer refuses to step on gradients that were never synchronized
"""

import contextlib
import functools
import types
from typing import List, Optional

import torch

from .bucket import Bucket
from .distributed_data_parallel_config import UNSHARDED_GRADIENT_STRATEGIES
from .grad_checks import (
    globally_unused_params,
    raise_if_any_rank_found_nonfinite,
    raise_if_params_replaced,
    raise_if_requires_grad_changed,
    unused_parameters_message,
)
from .grad_sync import GradSyncSchedule
from .model_checks import sparse_grad_error


class GradHooksMixin:
    """Mixin of DistributedDataParallel: its gradient hooks and gradient-sync calls.

    Reads what the wrapper's constructor built: `ddp_config`, `param_to_name`, `param_to_bucket`,
    `param_and_grad_buffers` / `expert_parallel_buffers`, `expert_params`, the data-parallel groups,
    `_all_named_params` and (for ZeRO-3's releases) `param_sync`.
    """

    def _register_grad_hooks(self, buckets: List[Bucket]):
        """Set up the gradient side over `buckets` (every bucket, dense then expert): the launch schedule,
        this iteration's state, and one post-accumulate-grad hook per parameter."""
        config = self.ddp_config
        # The buckets' gradient collectives in one fixed launch order (grad_sync.py).
        registration = {p: i for i, p in enumerate(self.param_to_name)}
        self.grad_sync = GradSyncSchedule(buckets, registration, config.sharding.gradients, config.sharding.parameters,
                                          config.find_unused_parameters)
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

        self._grad_hook_handles = []  # remove_grad_hooks()
        for bucket in buckets:
            for index, param in enumerate(bucket.params_list):
                self._grad_hook_handles.append(param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready_hook, bucket=bucket, index=index)))

    def remove_grad_hooks(self):
        """Unregister the gradient-ready hooks from the parameters (live recovery discards a wrapper after a
        failure: a hook held by a parameter keeps the wrapper, its buckets and their process groups alive,
        out of the garbage collector's sight, and a gloo group releases its peers only once freed)."""
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles = []

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
            self.grad_sync.before_arrival(bucket)  # ZeRO-2/3: free what a finished collective holds first
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
            self.grad_sync.launch_ready()
        self.param_sync.grad_arrived(bucket, index)  # ZeRO-3: its backward done, release the full parameters

    # ---------------------------------------------------------------- the public protocol (gradient side)
    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside the context accumulate in main_grad; nothing is communicated."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self, *unused):
        """Launch the collectives of all buckets not launched yet (async with overlap_grad_reduce).
        Positional arguments (megatron-core's signature: a hook's arguments) are ignored."""
        self.grad_sync.launch_rest()

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
        force_all_reduce = bool(force_all_reduce)
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
        # ZeRO-3: first issue the parameter gathers this rank skipped (a branch it did not run), before blocking
        # on the gradient collectives: a peer may be waiting for one of them in its backward, and only then
        # issue the gradient collectives this rank would wait for.
        self.param_sync.end_backward()
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
            raise_if_params_replaced(self.module, self._all_named_params)  # the reason, if it is one
            raise ValueError(unused_error)
        if self._overlap:
            self.grad_sync.learn_expected_counts()  # the first complete iteration sets what to expect
        raise_if_requires_grad_changed(self._all_named_params)
        if self.ddp_config.check_for_nan_in_grad:
            raise_if_any_rank_found_nonfinite(self.param_and_grad_buffers + self.expert_parallel_buffers,
                                              self.data_parallel_group)

    def zero_grad_buffer(self):
        """Zero all main_grads and reset bucket state; call at the start of every iteration."""
        raise_if_params_replaced(self.module, self._all_named_params)
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
