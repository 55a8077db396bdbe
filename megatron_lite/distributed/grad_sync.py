"""The buckets' gradient collectives, launched in one fixed order (the role of megatron-core's bucket groups).

Buckets are launched in the order their gradients are expected in backward, never in the order they happen
to complete: every rank then issues the same sequence of collectives even when autograd visits parameters
in a rank-dependent order. A complete bucket waits for the earlier ones; finish_grad_sync launches what is
left (buckets whose parameters got no gradient included) and waits for every bucket.
"""

import math
from typing import Dict, List

import torch

from .bucket import Bucket

ZERO2_BUCKETS_IN_FLIGHT = 2
"""ZeRO-2 with overlap: launched buckets whose full gradients may still exist (an older one is then waited for)."""

ZERO3_BUCKETS_IN_FLIGHT = 1
"""ZeRO-3: one launched bucket at a time, FSDP2's rule (a unit's reduce-scatter is waited for when the next one is
issued, a unit's backward later): each one in flight holds a unit's full gradients and, at dp > 2 on gloo, a
unit-sized scratch (collectives.py), which at ZeRO-3's 16/d bytes per parameter is what the window costs."""


class GradSyncSchedule:
    """Args:
        buckets: every bucket of the wrapper (dense and expert buffers).
        registration: each trainable parameter's index in the model's registration order.
        shards_grads: whether buckets free their full-size gradients once reduced (ZeRO-2/3): then at most
            ZERO2_BUCKETS_IN_FLIGHT launched buckets keep them while backward goes on.
        shards_params: ZeRO-3: ZERO3_BUCKETS_IN_FLIGHT instead.
        ranks_may_differ: find_unused_parameters, where ranks may run different branches. Under ZeRO-3 no rank
            then waits for a gradient collective during backward (only completed ones are finished there): a
            peer that skipped the bucket's unit launches it in finish_grad_sync only, and may be waiting in its
            own backward for a parameter gather this rank issues only there too. The in-flight bound is lost.
    """

    def __init__(self, buckets: List[Bucket], registration: Dict[torch.nn.Parameter, int], shards_grads: bool,
                 shards_params: bool = False, ranks_may_differ: bool = False):
        # By when a bucket's last gradient is expected (its earliest-registered parameter arrives last in
        # backward). Within one buffer this is simply bucket order. Dense and expert buckets interleave, by
        # rank if expert groups hold different experts: deadlock-free all the same, as every rank issues the
        # dense buckets in one order and every rank of an expert group its buckets in one.
        self.order: List[Bucket] = sorted(buckets, key=lambda b: -min(registration[p] for p in b.params_list))
        # Without gradient sharding no bound: the full-size buffer persists anyway.
        self.window = ZERO3_BUCKETS_IN_FLIGHT if shards_params else ZERO2_BUCKETS_IN_FLIGHT if shards_grads \
            else math.inf
        self.shards_params = shards_params
        self.wait_in_backward = not (shards_params and ranks_may_differ)
        self.next = 0  # the next bucket to launch, in order
        self.oldest = 0  # the first launched bucket that may not be finished yet

    @property
    def pending(self) -> List[Bucket]:
        """The buckets not launched yet, in order."""
        return self.order[self.next:]

    def reset(self):
        """A new iteration: nothing launched."""
        self.next = self.oldest = 0

    def launch_ready(self):
        """Launch complete buckets, strictly in order (a complete bucket waits for earlier ones)."""
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
