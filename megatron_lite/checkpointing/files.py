"""Checkpoint directories on disk, as one process sees them: naming, atomic writes, manifest, sealing, scans.

::

    SAVE/latest_checkpointed_iteration.txt   "200": a hint, written last
    SAVE/iter_0000200/model_optim_rng.pt     the state (torch_format.py; torch_dist.py: its own files)
    SAVE/iter_0000200/manifest.json          size and sha256 of every file: written last inside the
                                             directory, so a directory with a manifest is complete
    SAVE/.tmp_iter_0000200_*/                a save in progress (or a crashed one, removed by the next save)
    SAVE/job.lock                            locked by the job saving here ("pid 1234 on node7"), removed at
                                             its end: one job per directory (lock_save_directory)
    SAVE/last_words/iter_0000123/            the survivors' last words of iteration 123 (last_words.py),
                                             removed once a periodic checkpoint at or after 123 is sealed

A directory is written under a temporary name (new_directory), fsynced, and sealed (seal_directory): the
manifest, the rename into place, and only then the tracker. save.py runs this over every rank (rank 0 makes
and seals the directory, every rank writes its part in between); tools in one process call the same two
functions. Loading takes the newest directory that has a manifest (the tracker only confirms it) and checks
every file against the manifest first: a flipped byte, a truncated or an empty file is an error naming the
file, never a silently loaded state. Files and directories get the usual permissions of the process
(umask), like the rest of the run's outputs. Nothing here communicates.

One job writes into a --save directory at a time: the job's rank 0 holds a POSIX record lock on SAVE/job.lock
(fcntl.lockf) while it trains, and a second job is refused naming the directory and the holder. The kernel
drops the lock when the holding process ends, however it ends (a crash, SIGKILL), so a stale lock never blocks
a restart; and a POSIX lock, unlike flock(), belongs to the process alone, not to the children it forks
(DataLoader workers), so it is free the moment the holder is gone, e.g. for the rank 0 that the live-recovery
supervisor starts in place of a killed one. On a filesystem without lock support (NFS without a lock daemon:
ENOLCK; some FUSE mounts: EOPNOTSUPP, ENOSYS) the job trains unguarded after a warning that names the directory;
the call is non-blocking, but a hard-mounted NFS whose lock server does not answer can still block in it.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from typing import Callable, Dict, Optional, Tuple

CHECKPOINT_VERSION = 2  # stored in both formats' state; 2: a manifest with checksums (and the torch_dist format)
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MANIFEST_FILENAME = "manifest.json"
# The key of a checkpoint with model weights only (no optimizer state, no RNG; tools/checkpoint_convert.py --from
# hf writes it, its value says where the weights came from): load.py loads it only with --finetune.
WEIGHTS_ONLY_KEY = "weights_only"
# Architecture args recorded since a later version, and what a checkpoint saved before (its args lack the key)
# was trained with: compared on resume as that value, not skipped.
ABSENT_ARGS = {"openai_gelu": False}
LAST_WORDS_DIRNAME = "last_words"
LOCK_FILENAME = "job.lock"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")

# ------------------------------------------------------------------------------------------ the commit guard
_commit_guard: Optional[Callable[[str, str], None]] = None


def set_commit_guard(guard: Optional[Callable[[str, str], None]]):
    """Install `guard(kind, what)`, called right before a checkpoint is committed (kind "checkpoint": the rename
    of its sealed directory into place, which the tracker follows) and before a rank's last words are written
    (kind "last_words"); it raises to refuse. Live recovery installs its fencing (a process cut off from its job,
    or of a generation that was abandoned, must not commit a stale state); None removes it. The commit then
    fails like any failed save: the temporary directory is removed, the previous checkpoint stays the newest."""
    global _commit_guard
    _commit_guard = guard


def check_commit(kind: str, what: str):
    """Ask the commit guard (set_commit_guard), if one is installed, whether `what` may be committed."""
    if _commit_guard is not None:
        _commit_guard(kind, what)


# ------------------------------------------------------------------------------------------ naming
def _iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int) -> str:
    """The periodic checkpoint of `iteration` under the --save directory `root`."""
    return os.path.join(root, _iteration_name(iteration))


def last_words_dir(root: str, iteration: int) -> str:
    """Where the last words of `iteration` are written under the --save directory `root`."""
    return os.path.join(root, LAST_WORDS_DIRNAME, _iteration_name(iteration))


def iteration_entries(base: str) -> Dict[int, str]:
    """iteration -> path of every entry of `base` named like an iteration's directory (complete or not)."""
    names = os.listdir(base) if os.path.isdir(base) else []
    return {int(m.group(1)): os.path.join(base, m.group(0)) for m in map(ITER_DIR.match, names) if m}


def last_words_entries(root: str) -> Dict[int, str]:
    """iteration -> directory of every last-words set under the --save directory `root` (complete or not)."""
    return iteration_entries(os.path.join(root, LAST_WORDS_DIRNAME))


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
            _remove_stale(os.path.join(root, name))
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp_{os.path.basename(final)}_", dir=root)
    os.chmod(tmp_dir, 0o777 & ~_umask())
    return tmp_dir


def _remove_stale(path: str):
    """Remove what a crashed save (or anything else) left under a temporary name: a directory with its contents,
    anything else (a file, a symbolic link: never followed, whatever it points to) by unlinking it."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass  # gone already
    except OSError as e:  # shutil's errors may name a file inside, or nothing at all
        raise OSError(e.errno, f"cannot remove {path}, a temporary entry left in the --save directory by an "
                               f"earlier save ({e.strerror or e}): remove it by hand") from e


def seal_directory(root: str, iteration: int, tmp_dir: str):
    """Seal a written temporary directory: the manifest, the commit guard's consent, the rename into place and,
    last, the tracker; then remove the last-words sets this checkpoint supersedes. A failure before the
    tracker moves removes tmp_dir and leaves the previous checkpoint the newest."""
    final = checkpoint_dir(root, iteration)
    try:
        files = {}
        for dirpath, _, names in os.walk(tmp_dir):
            for name in names:
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, tmp_dir)] = {"size": os.path.getsize(path), "sha256": digest(path)}
        manifest = json.dumps({"iteration": iteration, "files": dict(sorted(files.items()))}, indent=1).encode()
        write_atomically(os.path.join(tmp_dir, MANIFEST_FILENAME), lambda f: f.write(manifest))
        check_commit("checkpoint", f"committing checkpoint {iteration} to {final}")
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


# ------------------------------------------------------------------------------------------ one job per directory
# lockf's errors where the filesystem has no (working) lock support: NFS without a lock daemon (ENOLCK), some
# FUSE and object-store mounts (EOPNOTSUPP, ENOSYS)
_NO_LOCK_SUPPORT = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
_locked: Dict[str, int] = {}  # realpath of a --save directory -> the descriptor holding this process's lock on it


def lock_save_directory(root: str, job: Optional[str] = None):
    """Lock the --save directory `root` for this process (see the module docstring), until
    unlock_save_directory(root) or the end of the process. Locking a directory this process holds already
    is a no-op. Raises ValueError naming `root` and the holder when another process holds it.

    `job` (live recovery: the job's id, the same in every process of it, replacements included) is written
    with the holder. A holder of the same job is a rank 0 of an earlier generation that cannot release the
    lock (its node hung or cut off: stopped, not dead, it keeps its locks): this process then goes on without
    the lock, with a warning, instead of refusing the job its own directory; that process is fenced (it
    commits nothing: set_commit_guard)."""
    os.makedirs(root, exist_ok=True)
    key = os.path.realpath(root)
    if key in _locked:  # a POSIX lock is the process's: a second descriptor's close() would drop it
        return
    path = os.path.join(root, LOCK_FILENAME)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            raise OSError(e.errno, f"cannot open the --save directory's lock file {path}: {e.strerror}") from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said which yet"
            os.close(fd)  # this process holds no lock on the file: closing drops nothing
            if e.errno in _NO_LOCK_SUPPORT:  # the guard is a safety net: train unguarded rather than not at all
                warnings.warn(f"--save {root}: its filesystem does not support locks ({path}: {e.strerror}), so "
                              f"nothing stops a second job from saving into this directory at the same time; "
                              f"make sure only one job uses it", stacklevel=2)
                return
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise OSError(e.errno, f"cannot lock {path}: {e.strerror}") from e
            if job is not None and holder.split(" for job ", 1)[1:] == [job]:
                warnings.warn(f"--save {root}: {holder} holds {path}, a process of this job that has not released "
                              f"it (a rank 0 of an earlier generation, stopped or cut off; fenced, it commits "
                              f"nothing): going on without the lock", stacklevel=2)
                return
            raise ValueError(f"--save {root} is in use by another job ({holder} holds {path}): two jobs saving into "
                             f"one directory overwrite and shadow each other's checkpoints. Wait for that job to "
                             f"end, or save into another directory") from None
        # The holder removes the file when it ends cleanly: a lock taken on a file removed meanwhile is no lock.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    owner = f"pid {os.getpid()} on {socket.gethostname()}" + (f" for job {job}" if job is not None else "")
    os.pwrite(fd, f"{owner}\n".encode(), 0)
    _locked[key] = fd


def unlock_save_directory(root: str):
    """Release this process's lock on `root` (lock_save_directory), removing the lock file; nothing to do when
    it holds none. (A process that dies leaves the file, with its pid: the lock itself is gone.)"""
    fd = _locked.pop(os.path.realpath(root), None)
    if fd is not None:
        try:  # removed while still locked: a job that opens the path from now on creates a new file
            os.unlink(os.path.join(os.path.realpath(root), LOCK_FILENAME))
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


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
    return {iteration: path for iteration, path in iteration_entries(root).items()
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
    partial = [iteration for iteration in iteration_entries(root) if iteration not in complete]
    if partial and (newest is None or max(partial) > newest):
        raise ValueError(f"{checkpoint_dir(root, max(partial))} has no {MANIFEST_FILENAME}: it is not a complete "
                         f"checkpoint of this megatron_lite version. Move it away to resume from "
                         f"{'iteration ' + str(newest) if newest is not None else 'scratch'}.")
    return (newest, complete[newest]) if newest is not None else (None, None)
