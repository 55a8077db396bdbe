"""Data parallelism (mirrors megatron.core.distributed)."""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "ParamAndGradBuffer", "Bucket"]
