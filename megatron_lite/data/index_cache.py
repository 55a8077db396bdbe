"""Index arrays cached on disk under a name that is the hash of what they were built from.

::

    PATH_TO_CACHE/<md5 of the description>-GPTDataset-train-description.txt      the description (JSON)
                  <md5 of the description>-GPTDataset-train-document_index.npy   one .npy per array
                  <md5 ...>-GPTDataset-train-sample_index.npy, ...-shuffle_index.npy
                  <md5 ...>-GPTDataset-train-digests.json    sha256 and stat of each file (megatron-lite's)

megatron-core's naming (`--data-cache-path`), with one file of megatron-lite's beside it: megatron-core
reads the arrays of the four files it names and never this one, and the description stays the text whose
md5 is in the name. The digests make a set verifiably this configuration's: arrays copied from another
configuration under these names (the same shapes, every value in range), or damaged in place, would otherwise
load as this run's sample order. Each file is written under a temporary name and renamed into place, the
digests and then the description last, so a reader sees the whole set or none: several ranks or jobs may
build at once (they write the same bytes) and a killed build leaves nothing half-written. pretrain_gpt.py
lets rank 0 build first while the other ranks wait (collectives.rank_zero_first); they then load. A set
whose description differs, that has no digests (an older megatron-lite's, a partial copy), whose files do not
match their digests, or whose arrays cannot be read or fail the caller's check is rebuilt and replaced, with
a warning naming the file and the reason.

Verifying costs a stat per file, not a read: hashing every array on every load (each rank, each start) reads
GBs at Megatron's scale, where the arrays are otherwise memory-mapped and read only where sampled. A file
is hashed again only when its (size, mtime_ns, inode) differs from what was recorded when its sha256 was
taken (a copy: another inode, or rewritten: another mtime), or when its mtime is not older than the digests
file's own (git's "racy" rule: a change within the clock tick of the recorded one would keep its mtime).
So a set copied elsewhere verifies in full on each load (the small description always does), and only a
same-size file written into the same inode with exactly the recorded mtime goes unseen (its time reset by
`touch -d`, or copied with its times from a file written in the same clock tick).
"""

import hashlib
import json
import os
import uuid
import warnings
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np


def description_hash(description: Dict) -> Tuple[str, str]:
    """The description as megatron-core writes it (JSON, indent 4) and its md5 hex digest."""
    text = json.dumps(description, indent=4)
    return text, hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def cached_indices(path_to_cache: Optional[str], description: Dict, kind: str, names: Sequence[str],
                   build: Callable[[], Sequence[np.ndarray]],
                   check: Callable[[Sequence[np.ndarray]], Optional[str]]) -> Tuple[Tuple[np.ndarray, ...], bool]:
    """Load the arrays `names` of `description` from the cache, or build and save them.

    Args:
        path_to_cache: the directory (created if needed); None builds in memory without saving.
        description: JSON-serializable dict of everything the arrays depend on.
        kind: the file name's middle part, e.g. 'GPTDataset-train'.
        names: the arrays' names, in the order `build` returns them.
        build: () -> the arrays.
        check: arrays -> None when they are consistent with the description, else the reason.

    Returns:
        (arrays, cache_hit). Loaded arrays are read-only memory maps.

    Raises:
        ValueError naming --data-cache-path when the directory cannot be written.
    """
    if path_to_cache is None:
        return tuple(build()), False
    text, digest = description_hash(description)
    base = os.path.join(path_to_cache, f"{digest}-{kind}-")
    description_path, digests_path = base + "description.txt", base + "digests.json"
    paths = [base + name + ".npy" for name in names]
    reason = _load_problem(description_path, text, digests_path, paths, check)
    if isinstance(reason, tuple):
        return reason, True
    if reason is not None:
        warnings.warn(f"{description_path}: the cached indices are unusable ({reason}); rebuilding them",
                      stacklevel=2)
    arrays = tuple(build())
    try:
        os.makedirs(path_to_cache, exist_ok=True)
        for path, array in zip(paths, arrays):
            _write_atomically(path, lambda f, a=array: np.save(f, a, allow_pickle=False))
        sha256 = {os.path.basename(path): _sha256(path) for path in paths}
        sha256[os.path.basename(description_path)] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        digests = {"sha256": sha256, "stat": {os.path.basename(path): _stat(path) for path in paths}}
        _write_atomically(digests_path, lambda f: f.write(json.dumps(digests, indent=4).encode("utf-8")))
        _write_atomically(description_path, lambda f: f.write(text.encode("utf-8")))
    except OSError as e:
        raise ValueError(f"--data-cache-path {path_to_cache}: cannot write the dataset index cache ({e}); give "
                         "a writable directory") from e
    return arrays, False


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):  # hashlib.file_digest is Python 3.11+
            digest.update(chunk)
    return digest.hexdigest()


def _stat(path: str) -> list:
    """What changes when a file is rewritten or replaced: [size, mtime in ns, inode]."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _load_problem(description_path: str, text: str, digests_path: str, paths: Sequence[str], check):
    """The loaded arrays (a tuple), None when there is no cache yet, or the reason it cannot be used."""
    if not os.path.isfile(description_path):
        return None
    with open(description_path, "rb") as f:
        if f.read().decode("utf-8", errors="replace") != text:
            return "its description differs from this run's"
    try:
        with open(digests_path, "rb") as f:
            digests, digests_mtime = json.loads(f.read().decode("utf-8")), os.fstat(f.fileno()).st_mtime_ns
    except FileNotFoundError:
        return (f"{os.path.basename(digests_path)} is missing (written by a megatron-lite that kept no digests, "
                "or a partial copy), so the arrays cannot be verified as this configuration's")
    except (OSError, ValueError) as e:
        return f"{os.path.basename(digests_path)} is unreadable ({e})"
    if not (isinstance(digests, dict) and isinstance(digests.get("sha256"), dict)
            and isinstance(digests.get("stat"), dict)):
        return f"{os.path.basename(digests_path)} holds no sha256 and stat records"
    for path in [description_path, *paths]:
        name = os.path.basename(path)
        recorded = digests["stat"].get(name)
        try:
            if isinstance(recorded, list) and len(recorded) == 3 and recorded[1] < digests_mtime \
                    and _stat(path) == recorded:
                continue  # the file the sha256 was taken of, untouched since (module docstring)
            actual = _sha256(path)
        except OSError as e:
            return f"{name}: {e}"
        if digests["sha256"].get(name) != actual:
            return (f"{name} is not the file written with this description (sha256 {actual[:12]}... differs "
                    f"from {os.path.basename(digests_path)}): copied from another configuration, or damaged")
    arrays = []
    for path in paths:
        try:
            arrays.append(np.load(path, mmap_mode="r", allow_pickle=False))
        except (OSError, ValueError, EOFError) as e:
            return f"{os.path.basename(path)}: {e}"
    problem = check(arrays)
    return tuple(arrays) if problem is None else problem


def _write_atomically(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
