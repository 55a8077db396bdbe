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


class GradSyncSchedule:
    """Args:
        buckets: every bucket of the wrapper (dense and expert buffers).
        registration: each trainable parameter's index in the model's registration order.
        shards_grads: whether buckets free their full-size gradients once reduced (ZeRO-2/3): then at most
            ZERO2_BUCKETS_IN_FLIGHT launched buckets keep them while backward goes on.
    """

    def __init__(self, buckets: List[Bucket], registration: Dict[torch.nn.Parameter, int], shards_grads: bool):
        # By when a bucket's last gradient is expected (its earliest-registered parameter arrives last in
        # backward). Within one buffer this is simply bucket order. Dense and expert buckets interleave, by
        # rank if expert groups hold different experts: deadlock-free all the same, as every rank issues the
        # dense buckets in one order and every rank of an expert group its buckets in one.
        self.order: List[Bucket] = sorted(buckets, key=lambda b: -min(registration[p] for p in b.params_list))
        # Without gradient sharding no bound: the full-size buffer persists anyway.
        self.window = ZERO2_BUCKETS_IN_FLIGHT if shards_grads else math.inf
        self.next = 0  # the next bucket to launch, in order

    @property
    def pending(self) -> List[Bucket]:
        """The buckets not launched yet, in order."""
        return self.order[self.next:]

    def reset(self):
        """A new iteration: nothing launched."""
        self.next = 0

    def launch_ready(self):
        """Launch complete buckets, strictly in order (a complete bucket waits for earlier ones)."""
        order = self.order
        while self.next < len(order) and order[self.next].is_ready():
            order[self.next].start_grad_sync()
            self.next += 1
            if self.next > self.window:
                # ZeRO-2: bound the full-size gradients in flight; the oldest bucket's shard is kept and
                # its full gradients freed while backward goes on.
                order[self.next - 1 - self.window].finish_grad_sync()

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
