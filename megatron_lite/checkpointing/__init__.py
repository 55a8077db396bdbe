"""Checkpoints (work in progress: being split into modules)."""

from .last_words import LastWords
from .load import PendingSave, checkpoint_args, load_checkpoint, refuse_to_shadow, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "PendingSave", "refuse_to_shadow", "checkpoint_args", "LastWords"]
