"""Index arrays cached on disk under a name that is the hash of what they were built from.

::

    PATH_TO_CACHE/<md5 of the description>-GPTDataset-train-description.txt      the description (JSON)
                  <md5 of the description>-GPTDataset-train-document_index.npy   one .npy per array
                  <md5 ...>-GPTDataset-train-sample_index.npy, ...-shuffle_index.npy

megatron-core's naming (`--data-cache-path`). Each file is written under a temporary name and renamed into
place, the description last, so a reader sees the whole set or none: several ranks or jobs may build at
once and a killed build leaves nothing half-written. pretrain_gpt.py lets rank 0 build first while the
other ranks wait (collectives.rank_zero_first); they then load. A set whose description differs, or whose
arrays cannot be read or fail the caller's check (a truncated file, another corpus), is rebuilt and
replaced, with a warning naming the file and the reason.
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
    description_path = base + "description.txt"
    paths = [base + name + ".npy" for name in names]
    reason = _load_problem(description_path, text, paths, check)
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
        _write_atomically(description_path, lambda f: f.write(text.encode("utf-8")))
    except OSError as e:
        raise ValueError(f"--data-cache-path {path_to_cache}: cannot write the dataset index cache ({e}); give "
                         "a writable directory") from e
    return arrays, False


def _load_problem(description_path: str, text: str, paths: Sequence[str], check):
    """The loaded arrays (a tuple), None when there is no cache yet, or the reason it cannot be used."""
    if not os.path.isfile(description_path):
        return None
    with open(description_path, "rb") as f:
        if f.read().decode("utf-8", errors="replace") != text:
            return "its description differs from this run's"
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
