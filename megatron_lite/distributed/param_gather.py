"""Parameter synchronization where every rank keeps whole parameters (plain DDP, ZeRO-1/2): the distributed
optimizer's parameter all-gathers, in one fixed forward order on every rank, optionally deferred into the
next forward (`overlap_param_gather`).

After `optimizer.step()` each rank holds only its shard of every bucket's updated parameters. `start()`
all-gathers them right away, or, with overlap, only marks every bucket stale: a forward pre-hook on each
module with parameters then needs its buckets from the prefetch schedule (prefetch.py: dispatch in forward
order up to the bucket after the one needed) and waits for its own.

`ParamGather` and ZeRO-3's `ParamUnits` (param_units.py) answer the same calls from DistributedDataParallel
(start / finish, full_parameters, state_dict / iter_state_dict, the forward and gradient hooks), so the wrapper
never asks which strategy it runs; here the unit calls do nothing, as the parameters are never released.
"""

import contextlib
from typing import Dict, List

import torch

from .bucket import Bucket
from .prefetch import PrefetchSchedule


class ParamGather:
    """Args:
        gather_order: the buckets with a parameter buffer (distributed optimizer; none in plain DDP), in
            forward order (the reverse of the gradient launch order).
        param_to_bucket: every wrapped parameter's bucket.
        overlap: defer the gathers into the next forward (overlap_param_gather).
    """

    def __init__(self, gather_order: List[Bucket], param_to_bucket: Dict[torch.nn.Parameter, Bucket],
                 overlap: bool):
        self.schedule = PrefetchSchedule(gather_order, lambda bucket: bucket.start_param_sync())
        self.param_to_bucket = param_to_bucket
        self.overlap = overlap
        self._stale = set()  # buckets whose updated params have not arrived yet
        self.hook_handles = []  # forward pre-hooks (overlap), registered by build_param_sync

    @property
    def order(self) -> List[Bucket]:
        return self.schedule.order

    @property
    def pending(self) -> bool:
        """Whether some bucket's updated parameters have not been gathered yet."""
        return bool(self._stale)

    def start(self, force_sync: bool = False):
        """Gather every bucket's parameters, or (with overlap, unless `force_sync`) defer to the forward."""
        self.finish()
        if self.overlap and not force_sync:
            self._stale = set(self.order)
            self.schedule.restart()
            return
        for bucket in self.order:
            bucket.start_param_sync()
        for bucket in self.order:
            bucket.finish_param_sync()

    def finish(self):
        """Complete every pending gather (before checkpointing, evaluation or the next step)."""
        self.schedule.dispatch_all()
        for bucket in self.order:
            bucket.finish_param_sync()
        self._stale.clear()

    def forward_pre_hook(self, module, args):
        """Wait for the gathers of this module's buckets; prefetch the next bucket."""
        if not self._stale:
            return
        for param in module.parameters(recurse=False):
            bucket = self.param_to_bucket.get(param)
            if bucket is None or bucket not in self._stale:
                continue
            self.schedule.need(bucket)
            bucket.finish_param_sync()
            self._stale.discard(bucket)

    # ---------------------------------------------------------------- parameters are never released
    def full_parameters(self, write_back: bool = False):
        """Every parameter is whole already: nothing to gather."""
        return contextlib.nullcontext()

    def reading_placeholders(self):
        return contextlib.nullcontext()

    def state_dict(self, module: torch.nn.Module, *args, **kwargs):
        return module.state_dict(*args, **kwargs)

    def iter_state_dict(self, module: torch.nn.Module, prefix: str = "", keep_vars: bool = False):
        return iter(module.state_dict(prefix=prefix, keep_vars=keep_vars).items())

    def begin_forward(self):
        pass

    def end_forward(self):
        pass

    def grad_arrived(self, bucket: Bucket, index: int):
        pass

    def end_backward(self):
        pass

    def end_iteration(self):
        pass
