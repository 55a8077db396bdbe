"""The distributed optimizer's parameter all-gathers: one fixed forward order on every rank, optionally
deferred into the next forward (`overlap_param_gather`).

After `optimizer.step()` each rank holds only its shard of every bucket's updated parameters. `start()`
all-gathers them right away, or, with overlap, only marks every bucket stale: a forward pre-hook on each
module with parameters then dispatches the gathers in forward order up to the bucket after the one it
needs (a prefetch of one bucket) and waits for its own. Dispatch follows the fixed order, never the order
a rank's forward happens to reach the buckets in, so every rank issues the same sequence of collectives.
"""

from typing import Dict, List

import torch

from .param_and_grad_buffer import Bucket


class ParamGatherSchedule:
    """Args:
        gather_order: the buckets in forward order (the reverse of the gradient launch order).
        param_to_bucket: every wrapped parameter's bucket.
        overlap: defer the gathers into the next forward (overlap_param_gather).
    """

    def __init__(self, gather_order: List[Bucket], param_to_bucket: Dict[torch.nn.Parameter, Bucket],
                 overlap: bool):
        self.order = gather_order
        self.position = {id(b): i for i, b in enumerate(gather_order)}
        self.param_to_bucket = param_to_bucket
        self.overlap = overlap
        self._next = len(gather_order)  # nothing pending
        self._stale = set()  # ids of buckets whose updated params have not arrived yet

    @property
    def pending(self) -> bool:
        """Whether some bucket's updated parameters have not been gathered yet."""
        return bool(self._stale)

    def start(self, force_sync: bool = False):
        """Gather every bucket's parameters, or (with overlap, unless `force_sync`) defer to the forward."""
        self.finish()
        if self.overlap and not force_sync:
            self._stale = {id(b) for b in self.order}
            self._next = 0
            return
        for bucket in self.order:
            bucket.start_param_sync(async_op=True)
        for bucket in self.order:
            bucket.finish_param_sync()

    def finish(self):
        """Complete every pending gather (before checkpointing, evaluation or the next step)."""
        self._dispatch(len(self.order))
        for bucket in self.order:
            bucket.finish_param_sync()
        self._stale.clear()

    def _dispatch(self, upto: int):
        """Dispatch pending gathers in the fixed order up to position `upto` (exclusive)."""
        while self._next < min(upto, len(self.order)):
            self.order[self._next].start_param_sync(async_op=True)
            self._next += 1

    def forward_pre_hook(self, module, args):
        """Wait for the gathers of this module's buckets; prefetch the next bucket."""
        if not self._stale:
            return
        for param in module.parameters(recurse=False):
            bucket = self.param_to_bucket.get(param)
            if bucket is None or id(bucket) not in self._stale:
                continue
            self._dispatch(self.position[id(bucket)] + 2)  # this bucket and the next
            bucket.finish_param_sync()
            self._stale.discard(id(bucket))
