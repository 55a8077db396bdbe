"""GPT pre-training: arguments, LR schedule, checkpoints and the training loop (used by pretrain_gpt.py)."""

from .arguments import build_parser, parse_args, validate_args
from .checkpointing import load_checkpoint, save_checkpoint
from .scheduler import OptimizerParamScheduler
from .training import pretrain

__all__ = ["build_parser", "parse_args", "validate_args", "pretrain", "save_checkpoint", "load_checkpoint",
           "OptimizerParamScheduler"]
