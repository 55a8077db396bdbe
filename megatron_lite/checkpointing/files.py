"""Checkpoint directories on disk, as one process sees them: naming, atomic writes, manifest, sealing, scans.

::

    SAVE/latest_checkpointed_iteration.txt   "200": a hint, written last
    SAVE/iter_0000200/model_optim_rng.pt     the state (torch_format.py; torch_dist.py: its own files)
    SAVE/iter_0000200/manifest.json          size and sha256 of every file: written last inside the
                                             directory, so a directory with a manifest is complete
    SAVE/.tmp_iter_0000200_*/                a save in progress (or a crashed one, removed by the next save)
    SAVE/last_words/iter_0000123/            the survivors' last words of iteration 123 (last_words.py),
                                             removed once a periodic checkpoint at or after 123 is sealed

A directory is written under a temporary name (new_directory), fsynced, and sealed (seal_directory): the
manifest, the rename into place, and only then the tracker. save.py runs this over every rank (rank 0 makes
and seals the directory, every rank writes its part in between); tools in one process call the same two
functions. Loading takes the newest directory that has a manifest (the tracker only confirms it) and checks
every file against the manifest first: a flipped byte, a truncated or an empty file is an error naming the
file, never a silently loaded state. Files and directories get the usual permissions of the process
(umask), like the rest of the run's outputs. Nothing here communicates.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Callable, Dict, Optional, Tuple

CHECKPOINT_VERSION = 2  # stored in both formats' state; 2: a manifest with checksums (and the torch_dist format)
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MANIFEST_FILENAME = "manifest.json"
# The key of a checkpoint with model weights only (no optimizer state, no RNG; tools/checkpoint_convert.py --from
# hf writes it, its value says where the weights came from): load.py loads it only with --finetune.
WEIGHTS_ONLY_KEY = "weights_only"
LAST_WORDS_DIRNAME = "last_words"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


# ------------------------------------------------------------------------------------------ naming
def _iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int) -> str:
    """The periodic checkpoint of `iteration` under the --save directory `root`."""
    return os.path.join(root, _iteration_name(iteration))


def last_words_dir(root: str, iteration: int) -> str:
    """Where the last words of `iteration` are written under the --save directory `root`."""
    return os.path.join(root, LAST_WORDS_DIRNAME, _iteration_name(iteration))


def _iteration_entries(base: str) -> Dict[int, str]:
    """iteration -> path of every entry of `base` named like an iteration's directory (complete or not)."""
    names = os.listdir(base) if os.path.isdir(base) else []
    return {int(m.group(1)): os.path.join(base, m.group(0)) for m in map(_ITER_DIR.match, names) if m}


def last_words_entries(root: str) -> Dict[int, str]:
    """iteration -> directory of every last-words set under the --save directory `root` (complete or not)."""
    return _iteration_entries(os.path.join(root, LAST_WORDS_DIRNAME))


# ------------------------------------------------------------------------------------------ atomic writes
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable):
    """Write a file through a temporary sibling, fsync, then os.replace (atomic on POSIX)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; the run's outputs are not
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


def digest(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


# ------------------------------------------------------------------------------------------ sealing
def new_directory(root: str, iteration: int) -> str:
    """The temporary directory a checkpoint of `iteration` is written into (after removing what a crashed
    save left behind; one writer per directory). Refuses to replace an existing checkpoint."""
    os.makedirs(root, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists already: a checkpoint is never overwritten")
    for name in os.listdir(root):
        if name.startswith(".tmp_"):
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp_{os.path.basename(final)}_", dir=root)
    os.chmod(tmp_dir, 0o777 & ~_umask())
    return tmp_dir


def seal_directory(root: str, iteration: int, tmp_dir: str):
    """Seal a written temporary directory: the manifest, the rename into place and, last, the tracker; then
    remove the last-words sets this checkpoint supersedes. A failure before the tracker moves removes
    tmp_dir and leaves the previous checkpoint the newest."""
    final = checkpoint_dir(root, iteration)
    try:
        files = {}
        for dirpath, _, names in os.walk(tmp_dir):
            for name in names:
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, tmp_dir)] = {"size": os.path.getsize(path), "sha256": digest(path)}
        manifest = json.dumps({"iteration": iteration, "files": dict(sorted(files.items()))}, indent=1).encode()
        write_atomically(os.path.join(tmp_dir, MANIFEST_FILENAME), lambda f: f.write(manifest))
        os.rename(tmp_dir, final)
        _fsync_dir(root)
    except BaseException:
        discard_directory(tmp_dir)
        raise
    # Only now does the tracker move: a crash above leaves it (and the scan) at the previous checkpoint.
    write_atomically(os.path.join(root, TRACKER_FILENAME), lambda f: f.write(f"{iteration}\n".encode()))
    prune_last_words(root, iteration)


def discard_directory(tmp_dir: str):
    """Remove a temporary directory whose save failed (what a crash leaves, the next new_directory removes)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


def prune_last_words(root: str, upto: int):
    """Remove the last-words sets at or before `upto` (a periodic checkpoint at `upto` supersedes them)."""
    for iteration, path in last_words_entries(root).items():
        if iteration <= upto:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ reading
def verify(directory: str) -> Dict[str, dict]:
    """Check every file of a checkpoint directory against its manifest; returns the manifest's files."""
    manifest_path = os.path.join(directory, MANIFEST_FILENAME)
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"checkpoint manifest {manifest_path} is missing or unreadable ({e}): the directory "
                         f"is incomplete or was not written by this version of megatron_lite") from e
    for name, expected in files.items():
        path = os.path.join(directory, name)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != expected["size"]:
            raise ValueError(f"checkpoint file {path} is corrupt: {size} bytes, the manifest says "
                             f"{expected['size']} (truncated, emptied or missing)")
        if digest(path) != expected["sha256"]:
            raise ValueError(f"checkpoint file {path} is corrupt: its sha256 differs from the manifest's")
    return files


def complete_checkpoints(root: str) -> Dict[int, str]:
    """iteration -> directory of every checkpoint under `root` that has a manifest (a finished save)."""
    return {iteration: path for iteration, path in _iteration_entries(root).items()
            if os.path.exists(os.path.join(path, MANIFEST_FILENAME))}


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} is corrupt: expected an iteration number, found {text!r}")
    return int(text)


def find_latest(root: str) -> Tuple[Optional[int], Optional[str]]:
    """The newest complete checkpoint under `root`: (iteration, directory), or (None, None).

    Raises ValueError for a directory named like a checkpoint but without a manifest that is newer than
    every complete one: a crashed save never leaves one (it writes under a temporary name), so something
    else put it there, and resuming from an older checkpoint past it must be the user's decision."""
    complete = complete_checkpoints(root)
    newest = max(complete) if complete else None
    partial = [iteration for iteration in _iteration_entries(root) if iteration not in complete]
    if partial and (newest is None or max(partial) > newest):
        raise ValueError(f"{checkpoint_dir(root, max(partial))} has no {MANIFEST_FILENAME}: it is not a complete "
                         f"checkpoint of this megatron_lite version. Move it away to resume from "
                         f"{'iteration ' + str(newest) if newest is not None else 'scratch'}.")
    return (newest, complete[newest]) if newest is not None else (None, None)
