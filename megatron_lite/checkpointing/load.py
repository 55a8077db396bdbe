"""Loading a checkpoint on every rank: which one (this module), then its format's reader.

::

    _survey (each rank)       the newest complete periodic checkpoint (files.find_latest) and the complete
                              last-words sets (last_words.scan); another tool's checkpoint is refused
                              naming its converter (foreign.py)
    _agree_on_survey          every rank must have found the same, else ValueError on every rank
    newest last words first   if newer than the periodic checkpoint: last_words.load; a set no rank can
                              read in full is skipped on every rank (rank 0 names it), the next one tried
    the periodic checkpoint   the tracker is only a hint (rank 0 says when it disagrees); every file
                              checked against the manifest, then torch_format.py or torch_dist.py

Every step that reads files ends in an agreement of all ranks (collectives.run_collectively): a file one
rank cannot read ends every rank with its cause, or (last words) makes every rank fall back together, never
leaves the others waiting in the next collective. Files are loaded with `torch.load(weights_only=True)`:
no pickled code is executed (torch_dist's index: dcp_metadata.py).
"""

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import collectives
from . import experts, files, foreign, last_words, torch_dist, torch_format
from .rng import set_rng_state


def load_checkpoint(root: str, model, optimizer, scheduler, group=None, check_args: Optional[dict] = None,
                    hyperparameters: str = "check", finetune: bool = False, load_optim: bool = True,
                    load_rng: bool = True) -> Optional[dict]:
    """Load the newest complete checkpoint under `root` into model/optimizer/scheduler and restore RNG.

    Args:
        hyperparameters: how the schedule and optimizer hyperparameters stored in the checkpoint meet this
            run's: 'check' (a difference is an error), 'override' (this run's win) or 'checkpoint' (the
            checkpoint's win); Megatron's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
        finetune: Megatron's --finetune: the model weights only (as load_optim=False, load_rng=False), and a
            new run begins: the returned iteration and consumed_train_samples are 0.
        load_optim: False is Megatron's --no-load-optim: neither the optimizer state (moments, step counts,
            loss scale, hyperparameters) nor the learning-rate schedule's position is loaded, both stay as
            built; the main params are taken from the loaded model (optimizer.reload_model_params()).
        load_rng: False is Megatron's --no-load-rng: the RNG state is not restored.
    Returns:
        {'iteration', 'consumed_train_samples', 'args', 'path', 'checkpoint_iteration' (the iteration the
        checkpoint was saved at), 'finetune', 'unreadable_last_words' (newer last-words sets skipped because
        some shard could not be read on any rank)} or None when `root` holds no checkpoint.
    Raises:
        ValueError when a file fails its checksum, or the checkpoint's architecture (check_args keys) or
        hyperparameters differ from this run's.
    """
    load_optim, load_rng = load_optim and not finetune, load_rng and not finetune
    loaded = _load(root, model, optimizer, scheduler, group, check_args, hyperparameters, load_optim, load_rng)
    if loaded is None:
        return None
    if not load_optim:  # fp16/bf16 main params still hold the weights the model was built with
        optimizer.reload_model_params()
    loaded.update(checkpoint_iteration=loaded["iteration"], finetune=finetune)
    if finetune:
        loaded.update(iteration=0, consumed_train_samples=0)
    return loaded


def _load(root, model, optimizer, scheduler, group, check_args, hyperparameters, load_optim, load_rng):
    """load_checkpoint's choice: the newest last-words set every rank can read, else the newest periodic
    checkpoint (see the module docstring)."""
    iteration, directory, words, problems = collectives.run_collectively(_survey, root, group=group)
    _agree_on_survey(root, iteration, words, group)
    _report_skipped(problems, -1 if iteration is None else iteration, group)
    unreadable = []  # last-words sets skipped because a position could not be read on any rank
    for newest in sorted((i for i in words if iteration is None or i > iteration), reverse=True):
        loaded = last_words.load(words[newest], model, optimizer, scheduler, check_args, hyperparameters, group,
                                 load_optim, load_rng)
        if loaded is not None:
            return {**loaded, "unreadable_last_words": unreadable}
        unreadable.append(newest)
    if iteration is None:
        # A tracker says a checkpoint was saved here: the checkpoints were moved or deleted (Megatron fails
        # loading the iteration it names); training from scratch would overwrite the tracker without a word.
        if os.path.exists(os.path.join(root, files.TRACKER_FILENAME)):
            raise ValueError(f"{root} holds {files.TRACKER_FILENAME} but no complete checkpoint (were they moved or "
                             f"deleted?): restore them, or remove the tracker to train from scratch")
        return None
    try:
        tracker = files.read_tracker(root)
    except ValueError as e:  # the tracker is only a hint: a damaged one must not hide good checkpoints
        tracker = str(e)
    if tracker != iteration and dist.get_rank(group) == 0:
        print(f"> {root}: the tracker says {tracker}, the newest complete checkpoint is iteration {iteration}: "
              f"loading it", flush=True)
    return {**_load_periodic(directory, model, optimizer, scheduler, group, check_args, hyperparameters, load_optim,
                             load_rng), "unreadable_last_words": unreadable}


def _load_periodic(directory, model, optimizer, scheduler, group, check_args, hyperparameters, load_optim,
                   load_rng) -> dict:
    """The periodic checkpoint in `directory`, in its format: the small state file read and checked on every
    rank, the tensors checked to fit, the small state loaded, then the tensors."""
    is_torch_dist = torch_dist.is_torch_dist(directory)
    path = f"{directory}/{torch_dist.COMMON_FILENAME if is_torch_dist else torch_format.CHECKPOINT_FILENAME}"
    state = collectives.run_collectively(_read_verified, directory, path, check_args, group=group)
    if state.get(files.WEIGHTS_ONLY_KEY) and (load_optim or load_rng):  # the same file on every rank: all raise alike
        raise ValueError(f"checkpoint {path} holds model weights only ({state[files.WEIGHTS_ONLY_KEY]}): no optimizer "
                         f"state or RNG to resume, start from it with --finetune")
    if is_torch_dist:  # DCP's reads agree across ranks, and no tensor is written before all read theirs
        experts.refuse(optimizer, "loading a torch_dist checkpoint")
        torch_dist.load_torch_dist(directory, model, optimizer, state, group, load_optim)
    else:
        collectives.run_collectively(torch_format.check_fits, path, model, optimizer, state, load_optim, group=group)
    # The small state, checked on every rank (a hyperparameter may differ from this run's) before any
    # tensor of a 'torch' checkpoint is written: those writes include collectives.
    collectives.run_collectively(_load_small_state, state, optimizer, scheduler, hyperparameters, load_optim,
                                 load_rng, dist.get_rank(group), group=group)
    if not is_torch_dist:
        torch_format.load_tensors(model, optimizer, state, hyperparameters, load_optim)
    return {"iteration": state["iteration"], "consumed_train_samples": state["consumed_train_samples"],
            "args": state["args"], "path": path}


def _survey(root: str):
    """What `root` holds, read by this rank: (newest periodic iteration, its directory, complete last-words
    sets, problems of the others). Another tool's checkpoint (Megatron-LM, Hugging Face, DeepSpeed) is a
    ValueError naming it and its converter: read as ours it would be 'incomplete', or no checkpoint at all."""
    foreign_kind = foreign.describe_foreign(root)
    if foreign_kind:
        raise ValueError(foreign_kind)
    iteration, directory = files.find_latest(root)
    words, problems = last_words.scan(root)  # sets written by the survivors of a failure
    return iteration, directory, words, problems


def _agree_on_survey(root: str, iteration, words, group):
    """Every rank must find the same checkpoints: ranks reading different directories (no shared
    filesystem, or a save landing while the job starts) would load different states."""
    everyone = collectives.all_gather_object((iteration, sorted(words)), group)
    if any(seen != everyone[0] for seen in everyone):
        seen = "; ".join(f"rank {r}: periodic {s[0]}, last words {s[1]}" for r, s in enumerate(everyone))
        raise ValueError(f"the ranks find different checkpoints under {root} ({seen}): --load must name a "
                         f"directory that every rank reads alike (a shared filesystem), with no save writing to it")


def _report_skipped(problems: dict, newer_than: int, group):
    """Rank 0 says which last-words sets newer than `newer_than` cannot be used, and why."""
    if dist.get_rank(group) == 0:
        for iteration in sorted(problems):
            if iteration > newer_than:
                print(f"> skipping {problems[iteration]}", flush=True)


def _read_verified(directory: str, path: str, check_args: Optional[dict]) -> dict:
    """This rank's read of a periodic checkpoint: every file checked against the manifest, the state file
    loaded without running code, the architecture compared with this run's."""
    files.verify(directory)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint file {path} cannot be read: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not {"iteration", "consumed_train_samples", "args"} <= set(state):
        raise ValueError(f"checkpoint file {path} holds no megatron_lite training state")
    for key, value in (check_args or {}).items():
        saved = state["args"].get(key, files.ABSENT_ARGS.get(key))
        if saved is not None and saved != value:
            raise ValueError(f"checkpoint {path} was trained with {key}={saved}, this run has {key}={value}")
    return state


def _load_small_state(state: dict, optimizer, scheduler, hyperparameters: str, load_optim: bool, load_rng: bool,
                      rank: int):
    """The hyperparameters, the schedule's position and the RNG: local, and where they can fail (a
    hyperparameter that differs from this run's), before any tensor is written."""
    if load_optim:  # Megatron loads the schedule with the optimizer, or neither
        optimizer.load_common_state_dict(state["optimizer"], hyperparameters)
        scheduler.load_state_dict(state["opt_param_scheduler"], hyperparameters=hyperparameters)
    if load_rng:
        rng_states = state["rng_state"]
        set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
