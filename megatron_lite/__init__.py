"""megatron-lite: Megatron-LM's data-parallel training stack, small enough to read, running anywhere."""

from .distributed import (
    Bucket,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ParamAndGradBuffer,
    meta_device_init,
)
from .optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel", "DistributedDataParallelConfig", "ParamAndGradBuffer", "Bucket",
    "OptimizerConfig", "get_megatron_optimizer", "DistributedOptimizer", "meta_device_init",
]
