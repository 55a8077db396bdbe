"""Models (mirrors megatron.core.models): a GPT that imports torch only; DDP wraps it from the outside."""

from .gpt import GPTConfig, GPTModel, num_floating_point_operations

__all__ = ["GPTConfig", "GPTModel", "num_floating_point_operations"]
