"""Checkpoints: what a training state is made of, saved and restored on every rank.

Layout, atomicity and checksums: checkpoint_files.py. The model state and the optimizer state (full fp32
tensors per parameter name, see megatron_lite/optimizer/optimizer.py) do not depend on the data-parallel
size, so a run saved on N ranks resumes on M. Rank 0 writes; a failure there reaches every rank. Files
are loaded with `torch.load(weights_only=True)`: no pickled code is executed. A state with NaN/Inf in it
is never saved.
"""

import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import collectives
from . import files as checkpoint_files, torch_dist as dist_checkpoint, experts as expert_checkpoint, last_words

_serialize = torch.save  # module attribute so tests can simulate a crash in the middle of a write

CHECKPOINT_FILENAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 2  # 2: a manifest with checksums (and the torch_dist format)
# The run's arguments stored in a checkpoint and compared on load (Megatron's check_checkpoint_args).
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
                     "position_embedding_type", "untie_embeddings_and_output_weights", "max_position_embeddings")


def checkpoint_args(args) -> dict:
    """The plain-data part of `args` a checkpoint records: the architecture."""
    return {k: getattr(args, k) for k in ARCHITECTURE_ARGS}


def get_rng_state() -> dict:
    state = {
        "python": random.getstate(),
        # numpy's MT19937 key is uint32; stored as int64 (torch serializes uint32 storages poorly).
        "numpy": [torch.from_numpy(x.astype(np.int64)) if isinstance(x, np.ndarray) else x
                  for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = [x.numpy().astype(np.uint32) if isinstance(x, torch.Tensor) else x for x in state["numpy"]]
    np.random.set_state(tuple(np_state))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
        ckpt_format: 'torch' (the optimizer state gathered, one file written by rank 0) or 'torch_dist'
            (every rank writes what it owns through torch.distributed.checkpoint, dist_checkpoint.py).
        async_group: torch_dist only: write in the background, with this process group of its own.
    Returns:
        None when the checkpoint is complete on return; for an asynchronous save a PendingSave, whose
        wait() (every rank) completes the write and seals the checkpoint.
    """
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    if ckpt_format == "torch_dist":
        expert_checkpoint.refuse(optimizer, "ckpt_format='torch_dist'")
        return _save_torch_dist(root, iteration, model, optimizer, scheduler, consumed_train_samples, args, group,
                                async_group)
    if async_group is not None:
        raise ValueError("an asynchronous save needs ckpt_format='torch_dist'")
    model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    # Expert parameters: every expert-parallel position's, in a section of their own (expert_checkpoint.py).
    experts = expert_checkpoint.split(model, optimizer, model_state, optimizer_state, group)
    rng_states = collectives.all_gather_object(get_rng_state(), group)
    error = None
    if dist.get_rank(group) == 0:
        try:
            _refuse_nonfinite(iteration, {"model": model_state, "optimizer": optimizer_state, "experts": experts})
            _write_checkpoint(root, iteration, {
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                "consumed_train_samples": consumed_train_samples,
                "model": model_state,
                "optimizer": optimizer_state,
                "opt_param_scheduler": scheduler.state_dict(),
                "rng_state": rng_states,
                "args": args or {},
                **({} if experts is None else {expert_checkpoint.SECTION: experts}),
            })
        except BaseException as e:  # tell the other ranks instead of leaving them waiting
            error = e
    status = collectives.broadcast_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if status is not None:
        raise RuntimeError(f"saving checkpoint {iteration} failed on rank 0: {status}")


class PendingSave:
    """An asynchronous torch_dist save in flight: wait() (every rank, before the next save and at the end)
    completes the background write, agrees on its success and seals the directory (manifest, rename,
    tracker). Until then the checkpoint does not exist: a crash leaves only a temporary directory."""

    def __init__(self, future, root: str, iteration: int, tmp_dir: str, group):
        self.future, self.root, self.iteration, self.tmp_dir, self.group = future, root, iteration, tmp_dir, group

    def wait(self):
        collectives.run_collectively(self.future.result, group=self.group)
        _seal(self.root, self.iteration, self.tmp_dir, self.group)


def _save_torch_dist(root, iteration, model, optimizer, scheduler, consumed_train_samples, args, group,
                     async_group):
    rank = dist.get_rank(group)
    common = {
        "checkpoint_version": CHECKPOINT_VERSION, "format": "torch_dist", "iteration": iteration,
        "consumed_train_samples": consumed_train_samples, "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": collectives.all_gather_object(get_rng_state(), group), "args": args or {},
        "optimizer": optimizer.common_state_dict(), "optimizer_step": optimizer.agreed_step(),
        "optimizer_lagging_steps": optimizer.lagging_steps(optimizer.agreed_param_steps()),
        "shapes": {name: list(p.shape) for p, name in optimizer.param_to_name.items()},
    }

    def check_and_prepare():  # every rank checks what it will write; rank 0 makes the directory
        _refuse_nonfinite(iteration, {"model": dist_checkpoint.local_tensors(model, optimizer)})
        return checkpoint_files.new_directory(root, iteration) if rank == 0 else None
    dist_checkpoint.check_replicas(model, optimizer, group)  # several data-parallel groups: one replica is saved
    tmp_dir = collectives.broadcast_object(collectives.run_collectively(check_and_prepare, group=group), group)
    future = collectives.run_collectively(dist_checkpoint.save_torch_dist, tmp_dir, model, optimizer, common,
                                          group, async_group, group=group)
    if future is not None:
        return PendingSave(future, root, iteration, tmp_dir, group)
    _seal(root, iteration, tmp_dir, group)
    return None


def _seal(root: str, iteration: int, tmp_dir: str, group):
    """Every rank, once all wrote their part: rank 0 turns tmp_dir into checkpoint `iteration` (manifest,
    rename, tracker); a failure there is raised on every rank."""
    collectives.run_collectively(lambda: _finish(root, iteration, tmp_dir) if dist.get_rank(group) == 0 else None,
                                 group=group)


def _finish(root: str, iteration: int, tmp_dir: str):
    checkpoint_files.finish_directory(root, iteration, tmp_dir)
    last_words.prune(root, iteration)  # superseded by this checkpoint


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


def _write_checkpoint(root: str, iteration: int, payload: dict):
    """Rank 0: the payload as one file of a new checkpoint directory (see checkpoint_files.publish)."""
    def write_files(directory):
        checkpoint_files.write_atomically(f"{directory}/{CHECKPOINT_FILENAME}", lambda f: _serialize(payload, f))
    checkpoint_files.publish(root, iteration, write_files)
    last_words.prune(root, iteration)  # superseded by this checkpoint


def _report_skipped(problems: dict, newer_than: int, group):
    """Rank 0 says which last-words sets newer than `newer_than` cannot be used, and why."""
    if dist.get_rank(group) == 0:
        for iteration in sorted(problems):
            if iteration > newer_than:
                print(f"> skipping {problems[iteration]}", flush=True)


def refuse_to_shadow(save_dir: str, loaded: Optional[dict]):
    """Before a run writes into `save_dir`: every checkpoint there must be one this run resumed from (or
    older), else its saves would overwrite or shadow checkpoints it never loaded. A fine-tuning run
    (loaded['finetune']) resumed from nothing: it starts again at iteration 0. Raises ValueError."""
    existing = checkpoint_files.complete_checkpoints(save_dir)
    words = last_words.scan(save_dir)[0]
    for iteration in (loaded or {}).get("unreadable_last_words", ()):  # skipped on load; a later save prunes them
        words.pop(iteration, None)
    newest = max([*existing, *words]) if existing or words else None
    if newest is not None and loaded is not None and loaded.get("finetune"):
        raise ValueError(
            f"--save {save_dir} already holds checkpoints (newest: iteration {newest}); a --finetune run starts "
            f"again at iteration 0, so its saves would overwrite or be shadowed by them. Save into another "
            f"directory (to continue an interrupted fine-tuning, --load its --save directory without --finetune).")
    source = None if loaded is None else last_words.directory(save_dir, loaded["iteration"]) \
        if loaded.get("last_words") else existing.get(loaded["iteration"], "")
    resumed_here = loaded is not None and os.path.realpath(os.path.dirname(loaded["path"])) == os.path.realpath(source)
    if newest is not None and not (resumed_here and loaded["iteration"] == newest):
        raise ValueError(
            f"--save {save_dir} already holds checkpoints this run did not resume from (newest: iteration "
            f"{newest}); saving there would overwrite or shadow them. Resume with --load {save_dir}, or "
            f"save into another directory.")


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
    """load_checkpoint's reading: the newest last-words set every rank can read, else the newest periodic
    checkpoint. Every step that reads files ends in an agreement of all ranks (run_collectively): a file one
    rank cannot read ends every rank with its cause, or (last words) makes every rank fall back together,
    never leaves the others waiting in the next collective."""
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
        return None
    try:
        tracker = checkpoint_files.read_tracker(root)
    except ValueError as e:  # the tracker is only a hint: a damaged one must not hide good checkpoints
        tracker = str(e)
    if tracker != iteration and dist.get_rank(group) == 0:
        print(f"> {root}: the tracker says {tracker}, the newest complete checkpoint is iteration {iteration}: "
              f"loading it", flush=True)
    torch_dist = dist_checkpoint.is_torch_dist(directory)
    path = f"{directory}/{dist_checkpoint.COMMON_FILENAME if torch_dist else CHECKPOINT_FILENAME}"
    state = collectives.run_collectively(_read_verified, directory, path, check_args, group=group)
    if torch_dist:  # DCP's reads agree across ranks, and no tensor is written before all read theirs
        expert_checkpoint.refuse(optimizer, "loading a torch_dist checkpoint")
        dist_checkpoint.load_torch_dist(directory, model, optimizer, state, group, load_optim)
    else:
        collectives.run_collectively(_check_fits, path, model, optimizer, state, load_optim, group=group)
    # The small state, checked on every rank (a hyperparameter may differ from this run's) before any
    # tensor of a 'torch' checkpoint is written: those writes include collectives.
    collectives.run_collectively(_load_small_state, state, optimizer, scheduler, hyperparameters, load_optim,
                                 load_rng, dist.get_rank(group), group=group)
    if not torch_dist:
        model.load_state_dict(state["model"])
        if load_optim:
            optimizer.load_state_dict(state["optimizer"], hyperparameters=hyperparameters)
    return {"iteration": state["iteration"], "consumed_train_samples": state["consumed_train_samples"],
            "args": state["args"], "path": path, "unreadable_last_words": unreadable}


def _survey(root: str):
    """What `root` holds, read by this rank: (newest periodic iteration, its directory, complete last-words
    sets, problems of the others)."""
    iteration, directory = checkpoint_files.find_latest(root)
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


def _read_verified(directory: str, path: str, check_args: Optional[dict]) -> dict:
    """This rank's read of a periodic checkpoint: every file checked against the manifest, the state file
    loaded without running code, the architecture compared with this run's."""
    checkpoint_files.verify(directory)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint file {path} cannot be read: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not {"iteration", "consumed_train_samples", "args"} <= set(state):
        raise ValueError(f"checkpoint file {path} holds no megatron_lite training state")
    for key, value in (check_args or {}).items():
        saved = state["args"].get(key)
        if saved is not None and saved != value:
            raise ValueError(f"checkpoint {path} was trained with {key}={saved}, this run has {key}={value}")
    return state


def _check_fits(path: str, model, optimizer, state: dict, load_optim: bool):
    """A 'torch' checkpoint holds every tensor of this model with the model's shapes (checked before any
    is written: the writes include collectives, which a rank raising half-way would leave waiting)."""
    expert_checkpoint.merge(model, optimizer, state)  # this rank's expert-parallel position's experts
    shapes = {name: tuple(p.shape) for p, name in optimizer.param_to_name.items()}
    expected = set(shapes) | set(model.untrained_state_dict())
    missing, unexpected = sorted(expected - set(state["model"])), sorted(set(state["model"]) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} was saved from another model: it lacks {missing[:5]} and holds "
                         f"{unexpected[:5]}, which this model has not")
    for name, shape in shapes.items():
        if tuple(state["model"][name].shape) != shape:
            raise ValueError(f"checkpoint {path} holds {name} of shape {list(state['model'][name].shape)}, the "
                             f"model's is {list(shape)}: it was saved from another model")
    if load_optim:
        lacking = sorted(set(optimizer.param_to_name.values()) - set(state["optimizer"]["state"]))
        if lacking:
            raise ValueError(f"checkpoint {path} lacks the optimizer state of {lacking[:5]}")


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
