"""Checkpoints: saving and restoring a training state on every rank, in two formats, plus last words.

    save.py           save_checkpoint, PendingSave, refuse_to_shadow: the one sealing protocol (rank 0 makes
                      the directory, every rank writes its part, agreed, rank 0 seals); lock_save_directory:
                      one job per --save directory
    load.py           load_checkpoint: which checkpoint to load (survey, agreement across ranks, last words
                      before the periodic checkpoint, fallback), then its format's reader
    torch_format.py   the 'torch' format: one file with full tensors per parameter name, written by rank 0
    torch_dist.py     the 'torch_dist' format: every rank writes what it owns through torch.distributed.checkpoint
    dcp_metadata.py   reading torch_dist's index (.metadata, a pickle) without running code
    experts.py        every expert-parallel position's experts in a 'torch' checkpoint
    last_words.py     LastWords: what the survivors of a failure write (no collective), and loading it
    files.py          directory naming (periodic and last words), atomic writes, manifest, sealing, scans,
                      the --save directory's lock
    rng.py            get_rng_state / set_rng_state
    megatron_write.py a checkpoint's payload written as a Megatron-LM checkpoint (torch_dist or legacy torch),
                      for tools/checkpoint_convert.py --to megatron (the names: megatron_lm.py)
    hf_files.py       a transformers model directory's files (config.json, safetensors shards), checked and read
                      for tools/checkpoint_convert.py --from hf (the mapping: tools/hf_convert.py)
    megatron_read.py  a Megatron-LM checkpoint (torch_dist or legacy torch) as the torch format's payload, for
                      tools/checkpoint_convert.py --from megatron (names and QKV layout: megatron_lm.py; its
                      pickles read by foreign_pickle.py: torch's weights-only unpickler, unknown classes inert)

Imports go one way: save/load -> formats and last words -> files, rng (and experts, dcp_metadata). hf_files
and megatron_write, megatron_read stand apart: only tools/checkpoint_convert.py imports them.
"""

from .last_words import LastWords
from .load import load_checkpoint
from .rng import get_rng_state, set_rng_state
from .save import PendingSave, checkpoint_args, lock_save_directory, refuse_to_shadow, save_checkpoint

__all__ = [
    "save_checkpoint", "load_checkpoint", "PendingSave", "refuse_to_shadow", "lock_save_directory", "checkpoint_args",
    "LastWords", "get_rng_state", "set_rng_state",
]
