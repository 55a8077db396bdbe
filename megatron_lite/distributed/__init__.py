"""Data parallelism (mirrors megatron.core.distributed)."""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .meta_init import meta_device_init
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "ParamAndGradBuffer", "Bucket",
           "meta_device_init"]
