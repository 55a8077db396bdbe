"""Data parallelism (mirrors megatron.core.distributed). Its files, in the order data flows through them:

    distributed_data_parallel_config.py  DistributedDataParallelConfig: the knobs, and Sharding (what a strategy shards)
    model_checks.py                      wrap-time refusals: sparse gradients, Parameters sharing memory
    replica_check.py                     wrap-time check that every rank wraps the same model and config
    meta_init.py                         meta_device_init(): a meta-device model's initialization, recorded
    materialize.py                       MetaMaterializer: that initialization replayed a tensor at a time
    distributed_data_parallel.py         DistributedDataParallel: builds the buffers, holds grad_sync and param_sync
    expert_parallel.py                   expert parameters (allreduce=False): their groups and gradient scaling
    layout.py                            pure functions: where each parameter and bucket lives, which rank owns what
    param_and_grad_buffer.py             ParamAndGradBuffer: main_grad views into one flat buffer per dtype pair;
                                         this rank's ShardRanges (shard_ranges) and gather_full_buffers
    bucket.py                            Bucket: one collective's parameters, grad-ready counting, shard storage
    storage.py                           ReleasableStorage: ZeRO-2 gradients / ZeRO-3 parameters freed and regrown
    grad_sync.py                         GradSync: grad-ready hooks, no_sync, start/finish; GradSyncSchedule
    grad_checks.py                       finish_grad_sync's verdicts: unused parameters, NaN/Inf, frozen or replaced
    param_sync.py                        picks the parameter synchronization by config.sharding
    param_gather.py                      ParamGather (plain DDP, ZeRO-1/2): the optimizer's parameter all-gathers
    fsdp_units.py                        ZeRO-3's units, found at wrap time
    param_units.py                       ParamUnits (ZeRO-3): units gathered before forward/backward, released after
    param_guards.py                      ZeRO-3's guards against reading released parameters' placeholders
    prefetch.py                          PrefetchSchedule: gathers in a fixed order, a window ahead
    full_state_dict.py                   ZeRO-3's state dict read one unit gathered at a time
    collectives.py                       every collective of the library: the one place for gloo/NCCL quirks;
                                         DataParallelGroups, the topology's process groups
"""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .meta_init import meta_device_init
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "ParamAndGradBuffer", "Bucket",
           "meta_device_init"]
