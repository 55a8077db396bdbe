"""Saving a checkpoint on every rank, in either format, through one sealing protocol.

::

    rank 0                     every rank                              rank 0
    new_directory  --------->  write its part of the checkpoint  --->  seal_directory: manifest, rename,
    (after every rank checked  'torch': rank 0 the one file            tracker, prune superseded last words
     its part; broadcast)      'torch_dist': each rank its pieces
                               (async: in the background, agreed
                                in PendingSave.wait)
         agreed                          agreed                                 agreed

Every step ends in an agreement of all ranks (collectives.run_collectively): a failure on any rank raises
on every rank, the temporary directory is removed, and the previous checkpoint stays the newest; nothing
is renamed into place before every rank's part is written. A state with NaN/Inf in it is never saved.
The formats: torch_format.py, torch_dist.py; the directories: files.py.
"""

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..distributed import collectives
from . import experts, files, last_words, torch_dist, torch_format

# The run's arguments stored in a checkpoint and compared on load (Megatron's check_checkpoint_args).
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
                     "position_embedding_type", "untie_embeddings_and_output_weights", "max_position_embeddings",
                     "normalization", "swiglu", "group_query_attention", "num_query_groups", "disable_bias_linear",
                     "norm_epsilon", "rotary_base", "openai_gelu")
# Recorded: what tools/checkpoint_convert.py --to hf needs besides the architecture (the tokenizer, so the
# vocabulary before padding; the init and dropout of the exported config). Of these tokenizer_type and eod (the
# tokenizer's end-of-document id, set by initialize_megatron) are compared on resume (training.resume, except
# with --finetune); the export checks eod too.
RECORDED_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size", "eod",
                 "init_method_std", "hidden_dropout", "attention_dropout")


def architecture_args(args) -> dict:
    """The architecture part of `args`, which a resume must match (None: a flag this version lacks)."""
    return {k: getattr(args, k, None) for k in ARCHITECTURE_ARGS}


def checkpoint_args(args) -> dict:
    """The plain-data part of `args` a checkpoint records: the architecture and RECORDED_ARGS."""
    return {**architecture_args(args), **{k: getattr(args, k, None) for k in RECORDED_ARGS}}


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed_train_samples: int,
                    args: Optional[dict] = None, group=None, ckpt_format: str = "torch", async_group=None):
    """Save on all ranks.

    Args:
        root: the --save directory.
        iteration: completed iterations.
        model: the DistributedDataParallel model (its state_dict completes pending param gathers).
        optimizer, scheduler: the MegatronOptimizer and OptimizerParamScheduler.
        consumed_train_samples: data position.
        args: plain-data description of the run (stored for reference and architecture checks).
        ckpt_format: 'torch' (the optimizer state gathered, one file written by rank 0, torch_format.py) or
            'torch_dist' (every rank writes what it owns through torch.distributed.checkpoint, torch_dist.py).
        async_group: torch_dist only: write in the background, with this process group of its own.
    Returns:
        None when the checkpoint is complete on return; for an asynchronous save a PendingSave, whose
        wait() (every rank) completes the write and seals the checkpoint.
    """
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    if ckpt_format == "torch_dist":
        experts.refuse(optimizer, "ckpt_format='torch_dist'")
        common = torch_dist.common_state(iteration, optimizer, scheduler, consumed_train_samples, args, group)

        def check():  # every rank checks what it will write
            _refuse_nonfinite(iteration, {"model": torch_dist.local_tensors(model, optimizer)})

        def write_part(directory):
            return torch_dist.save_torch_dist(directory, model, optimizer, common, group, async_group)
        torch_dist.check_replicas(model, optimizer, group)  # several data-parallel groups: one replica is saved
    else:
        if async_group is not None:
            raise ValueError("an asynchronous save needs ckpt_format='torch_dist'")
        content = torch_format.payload(iteration, model, optimizer, scheduler, consumed_train_samples, args, group)

        def check():  # rank 0 alone writes, and checks
            if content is not None:
                _refuse_nonfinite(iteration, torch_format.tensors(content))

        def write_part(directory):
            if content is not None:
                torch_format.write(directory, content)
    tmp_dir, future = _write(root, iteration, check, write_part, group)
    if future is not None:
        return PendingSave(future, root, iteration, tmp_dir, group)
    _seal(root, iteration, tmp_dir, group)
    return None


class PendingSave:
    """An asynchronous torch_dist save in flight: wait() (every rank, before the next save and at the end)
    completes the background write, agrees on its success and seals the directory (manifest, rename,
    tracker). Until then the checkpoint does not exist: a crash leaves only a temporary directory."""

    def __init__(self, future, root: str, iteration: int, tmp_dir: str, group):
        self.future, self.root, self.iteration, self.tmp_dir, self.group = future, root, iteration, tmp_dir, group

    def wait(self):
        _agreed(self.future.result, tmp_dir=self.tmp_dir, group=self.group)
        _seal(self.root, self.iteration, self.tmp_dir, self.group)


# ------------------------------------------------------------------------------------------ the protocol
def _write(root: str, iteration: int, check: Callable[[], None], write_part: Callable[[str], object], group):
    """Every rank: check() its part, rank 0 makes the temporary directory, then write_part(directory).
    Returns (the directory, what write_part returned)."""
    rank = dist.get_rank(group)

    def check_and_prepare():
        check()
        return files.new_directory(root, iteration) if rank == 0 else None
    tmp_dir = collectives.broadcast_object(collectives.run_collectively(check_and_prepare, group=group), group)
    return tmp_dir, _agreed(write_part, tmp_dir, tmp_dir=tmp_dir, group=group)


def _agreed(fn: Callable, *args, tmp_dir: str, group):
    """fn(*args) on every rank, agreed; when it failed anywhere, rank 0 removes the temporary directory
    (every rank is past its writes then) and every rank raises."""
    try:
        return collectives.run_collectively(fn, *args, group=group)
    except BaseException:
        if dist.get_rank(group) == 0:
            files.discard_directory(tmp_dir)
        raise


def _seal(root: str, iteration: int, tmp_dir: str, group):
    """Every rank, once all wrote their part: rank 0 turns tmp_dir into checkpoint `iteration`
    (files.seal_directory); a failure there is raised on every rank."""
    def seal():
        if dist.get_rank(group) == 0:
            files.seal_directory(root, iteration, tmp_dir)
    collectives.run_collectively(seal, group=group)


def _refuse_nonfinite(iteration: int, states: dict):
    """A checkpoint with NaN/Inf in it would resume a broken run: name the first offending tensors."""
    bad = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(prefix)

    walk("", states)
    if bad:
        raise ValueError(f"refusing to save checkpoint {iteration}: NaN/Inf in {', '.join(bad[:5])}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))


# ------------------------------------------------------------------------------------------ before saving
def lock_save_directory(save_dir: str, group=None, job: Optional[str] = None):
    """Every rank, before a job reads or writes `save_dir`: the directory becomes this job's alone while it
    trains. The group's rank 0 locks it (files.lock_save_directory; the caller unlocks it at the end, or the
    process's end does), once every other rank dropped a lock it may hold (under live recovery the rank 0 of
    each generation holds it: a survivor may have been the rank 0 of a smaller generation). A directory
    another job holds raises on every rank, naming it and the holder (pid and host); one that a process of
    the same `job` holds does not (live recovery: files.lock_save_directory's `job`)."""
    rank = dist.get_rank(group)

    def release_unless_rank_0():
        if rank != 0:
            files.unlock_save_directory(save_dir)

    def lock_save_directory_on_rank_0():
        if rank == 0:
            files.lock_save_directory(save_dir, job)
    collectives.run_collectively(release_unless_rank_0, group=group)  # released before rank 0 tries
    collectives.run_collectively(lock_save_directory_on_rank_0, group=group)


def refuse_to_shadow(save_dir: str, loaded: Optional[dict]):
    """Before a run writes into `save_dir`: every checkpoint there must be one this run resumed from (or
    older), else its saves would overwrite or shadow checkpoints it never loaded. A fine-tuning run
    (loaded['finetune']) resumed from nothing: it starts again at iteration 0. Raises ValueError."""
    existing = files.complete_checkpoints(save_dir)
    words = last_words.scan(save_dir)[0]
    for iteration in (loaded or {}).get("unreadable_last_words", ()):  # skipped on load; a later save prunes them
        words.pop(iteration, None)
    newest = max([*existing, *words]) if existing or words else None
    if newest is not None and loaded is not None and loaded.get("finetune"):
        raise ValueError(
            f"--save {save_dir} already holds checkpoints (newest: iteration {newest}); a --finetune run starts "
            f"again at iteration 0, so its saves would overwrite or be shadowed by them. Save into another "
            f"directory (to continue an interrupted fine-tuning, --load its --save directory without --finetune).")
    source = None if loaded is None else files.last_words_dir(save_dir, loaded["iteration"]) \
        if loaded.get("last_words") else existing.get(loaded["iteration"], "")
    resumed_here = loaded is not None and os.path.realpath(os.path.dirname(loaded["path"])) == os.path.realpath(source)
    if newest is not None and not (resumed_here and loaded["iteration"] == newest):
        raise ValueError(
            f"--save {save_dir} already holds checkpoints this run did not resume from (newest: iteration "
            f"{newest}); saving there would overwrite or shadow them. Resume with --load {save_dir}, or "
            f"save into another directory.")
