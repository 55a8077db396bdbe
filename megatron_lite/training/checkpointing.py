"""Atomic, resumable, DP-size-independent checkpoints.

Layout (Megatron's names)::

    SAVE/latest_checkpointed_iteration.txt      "200"            <- written last, atomically
    SAVE/iter_0000200/model_optim_rng.pt        model, optimizer, scheduler, RNG, data position

The model state and the optimizer state (full fp32 tensors per parameter name, see
megatron_lite/optimizer/optimizer.py) do not depend on the data-parallel size, so a run saved on N ranks
resumes on M. Rank 0 writes into a temporary directory, fsyncs, then renames it into place and only then
updates the tracker file: a crash at any point leaves the previous checkpoint intact and `latest`
pointing at it. Files are loaded with `torch.load(weights_only=True)`: no pickled code is executed.
"""

import glob
import os
import random
import shutil
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import collectives

_serialize = torch.save  # module attribute so tests can simulate a crash in the middle of a write

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 1
# The run's arguments stored in a checkpoint and compared on load (Megatron's check_checkpoint_args).
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
                     "position_embedding_type", "untie_embeddings_and_output_weights", "max_position_embeddings")


def checkpoint_args(args) -> dict:
    """The plain-data part of `args` a checkpoint records: the architecture."""
    return {k: getattr(args, k) for k in ARCHITECTURE_ARGS}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: str, write):
    """Write a file through a temporary sibling, fsync, then os.replace (atomic on POSIX)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
                    args: Optional[dict] = None, group=None):
    """Save on all ranks (the optimizer state is gathered collectively); rank 0 writes.

    Args:
        root: the --save directory.
        iteration: completed iterations.
        model: the DistributedDataParallel model (its state_dict completes pending param gathers).
        optimizer, scheduler: the MegatronOptimizer and OptimizerParamScheduler.
        consumed_train_samples: data position.
        args: plain-data description of the run (stored for reference and architecture checks).
    """
    model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    rng_states = collectives.all_gather_object(get_rng_state(), group)
    error = None
    if dist.get_rank(group) == 0:
        try:
            _write_checkpoint(root, iteration, {
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                "consumed_train_samples": consumed_train_samples,
                "model": model_state,
                "optimizer": optimizer_state,
                "opt_param_scheduler": scheduler.state_dict(),
                "rng_state": rng_states,
                "args": args or {},
            })
        except BaseException as e:  # tell the other ranks instead of leaving them waiting
            error = e
    status = collectives.broadcast_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if status is not None:
        raise RuntimeError(f"saving checkpoint {iteration} failed on rank 0: {status}")


def _write_checkpoint(root: str, iteration: int, payload: dict):
    """Rank 0: write into a temporary directory, rename it into place, then move the tracker."""
    os.makedirs(root, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp_{os.path.basename(final)}_", dir=root)
    try:
        _write_atomically(os.path.join(tmp_dir, CHECKPOINT_FILENAME), lambda f: _serialize(payload, f))
        old = None
        if os.path.exists(final):  # re-saving an iteration: keep the old copy until the new one is in
            old = f"{final}.old-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp_dir, final)
        _fsync_dir(root)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    # Only now does `latest` move: a crash above leaves it pointing at the previous checkpoint.
    _write_atomically(os.path.join(root, TRACKER_FILENAME), lambda f: f.write(f"{iteration}\n".encode()))


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} is corrupt: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(root: str, model, optimizer, scheduler, group=None,
                    check_args: Optional[dict] = None) -> Optional[dict]:
    """Load the latest checkpoint under `root` into model/optimizer/scheduler and restore RNG.

    Returns:
        {'iteration', 'consumed_train_samples', 'args'} or None when `root` holds no checkpoint.
    Raises:
        ValueError when the checkpoint's architecture (check_args keys) differs from this run's.
    """
    iteration = read_tracker(root)
    if iteration is None:
        return None
    final = checkpoint_dir(root, iteration)
    candidates = [final] + sorted(glob.glob(f"{final}.old-*"))  # an interrupted re-save left .old
    path = next((os.path.join(c, CHECKPOINT_FILENAME) for c in candidates
                 if os.path.exists(os.path.join(c, CHECKPOINT_FILENAME))), None)
    if path is None:
        raise ValueError(f"{root}/{TRACKER_FILENAME} names iteration {iteration} but {final} has no {CHECKPOINT_FILENAME}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key, value in (check_args or {}).items():
        saved = state["args"].get(key)
        if saved is not None and saved != value:
            raise ValueError(f"checkpoint {path} was trained with {key}={saved}, this run has {key}={value}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    rng_states = state["rng_state"]
    rank = dist.get_rank(group)
    set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
    return {"iteration": state["iteration"], "consumed_train_samples": state["consumed_train_samples"],
            "args": state["args"]}
