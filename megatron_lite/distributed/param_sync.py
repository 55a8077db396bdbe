"""The parameter side of DistributedDataParallel, one object whatever the sharding strategy.

The wrapper's hot path makes the same calls for every strategy; what they do is decided once, here, by
what the config shards (`DistributedDataParallelConfig.sharding`):

    ===================  ===================================  ==========================================
    call                 ParamGather (plain DDP, ZeRO-1/2)    ParamUnits (ZeRO-3)
    ===================  ===================================  ==========================================
    start(force_sync)    all-gather updated shards (or defer  release the stale full parameters
                         them into the next forward)
    finish()             complete pending gathers             complete gathers in flight
    begin/end_forward    nothing                              gather the root / close the forward phase
    grad_arrived         nothing                              release a unit whose backward is done
    end_backward         nothing                              issue the gathers this rank skipped, release
                                                              (before the gradient collectives are waited for)
    end_iteration        nothing                              release all, check the gather sequence
    full_parameters      nothing (whole already)              gather every unit inside the context
    state_dict           module.state_dict()                  read unit by unit, copied
    iter_state_dict      module.state_dict()'s items          the same, one unit gathered at a time
    ===================  ===================================  ==========================================
"""

from typing import Dict, List, Union

import torch

from .bucket import Bucket
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_gather import ParamGather
from .param_units import ParamUnits

ParamSync = Union[ParamGather, ParamUnits]


def build_param_sync(module: torch.nn.Module, config: DistributedDataParallelConfig, buckets: List[Bucket],
                     launch_order: List[Bucket], units: List[torch.nn.Module],
                     unit_of: Dict[torch.nn.Parameter, int], group) -> ParamSync:
    """The parameter synchronization for `config`'s strategy over the wrapper's buckets.

    Args:
        module: the wrapped model (forward pre-hooks are registered on its submodules).
        buckets: every bucket, in buffer order (dense buffers first, then expert ones).
        launch_order: the same buckets in gradient launch order (parameters are gathered in its reverse).
        units, unit_of: ZeRO-3's units and each parameter's unit (fsdp_units.units_of).
        group: the group the dense parameters are sharded over (this rank's optimizer instance).
    """
    param_to_bucket = {p: bucket for bucket in buckets for p in bucket.params_list}
    if config.sharding.parameters:
        buckets_of_unit: Dict[int, List[Bucket]] = {}
        for bucket in buckets:
            buckets_of_unit.setdefault(unit_of[bucket.params_list[0]], []).append(bucket)
        return ParamUnits(module, units, buckets_of_unit, group, config.prefetch_bucket_size,
                          config.max_reuse_distance)
    # The distributed optimizer's all-gathers run in forward order: the reverse of launch order.
    gather_order = launch_order[::-1] if config.use_distributed_optimizer else []
    param_gather = ParamGather(gather_order, param_to_bucket, config.overlap_param_gather)
    if config.overlap_param_gather:
        for sub in module.modules():
            if any(p in param_to_bucket for p in sub.parameters(recurse=False)):
                param_gather.hook_handles.append(sub.register_forward_pre_hook(param_gather.forward_pre_hook))
    return param_gather
