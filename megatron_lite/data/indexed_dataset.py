"""A memory-mapped token dataset in two files: PREFIX.bin (tokens) and PREFIX.idx (document offsets).

::

    PREFIX.bin   | doc 0 tokens | doc 1 tokens | ... | doc n-1 tokens |     raw ids, uint16 or int32 (LE)
                 ^0             ^offsets[1]    ^offsets[2]            ^offsets[n] = num_tokens

    PREFIX.idx   | magic "MLITEIDX" | version u64 | dtype code u8 | 7 pad | n_docs u64 |   32-byte header
                 | offsets: n_docs + 1 int64 (LE), in tokens, offsets[0] = 0          |

Documents are stored back to back, so the corpus is one concatenated token stream and a document is a
slice of it. This is a simpler format than Megatron-LM's MMIDIDX (no separate sequence/document
levels); the files are not interchangeable. The builder writes both files under temporary names and
renames them into place, the .idx last, so a reader never sees a half-written dataset, and every
reader checks that the two files agree in size.
"""

import os
import struct
import uuid
from typing import Sequence

import numpy as np

MAGIC = b"MLITEIDX"
VERSION = 1
_HEADER = struct.Struct("<8sQB7xQ")  # magic, version, dtype code, padding (keeps offsets 8-aligned), n_docs
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_MEGATRON_MAGIC = b"MMIDIDX\x00"


def dtype_for_vocab_size(vocab_size: int) -> np.dtype:
    """Args: vocab_size. Returns: uint16 when every id fits with room to spare (< 65500), else int32."""
    return _DTYPES[1] if vocab_size < 65500 else _DTYPES[2]


def _fsync_dir(directory: str) -> None:
    # Makes the renames durable on POSIX; directories cannot be opened this way on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class IndexedDatasetBuilder:
    """Appends documents to PREFIX.bin/.idx; nothing is visible under PREFIX until `finalize()`.

    Usable as a context manager: a normal exit finalizes, an exception deletes the temporary files.

    Args:
        prefix: output path without extension (its directory is created if needed).
        vocab_size: every token id must be in [0, vocab_size); it also picks the on-disk dtype.
    """

    def __init__(self, prefix: str, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab_size(vocab_size)
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        # Unique temporary names in the same directory (so os.replace is an atomic rename): concurrent
        # builders of the same prefix never write into each other's files.
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = prefix + ".bin" + tag
        self._idx_tmp = prefix + ".idx" + tag
        self._bin_file = open(self._bin_tmp, "wb")
        self._offsets = [0]
        self._done = False

    def add_document(self, ids: Sequence[int]) -> None:
        """Append one document.

        Args:
            ids: its token ids (a list or a 1-D integer array; may be empty), eod included if wanted.
        """
        if self._done:
            raise ValueError(f"{self.prefix}: add_document after finalize()/abort()")
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if array.size:
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.vocab_size:
                # Without this check an id >= 65536 would silently wrap around in uint16.
                raise ValueError(
                    f"token id {low if low < 0 else high} out of range [0, {self.vocab_size}) "
                    f"(document {len(self._offsets) - 1} of {self.prefix})"
                )
            self._bin_file.write(array.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(array.size))

    def finalize(self) -> str:
        """Write PREFIX.idx and move both files into place (PREFIX.bin first, PREFIX.idx last).

        Returns:
            The prefix.
        """
        if self._done:
            raise ValueError(f"{self.prefix}: finalize() called twice or after abort()")
        self._done = True
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())
        self._bin_file.close()
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(self._offsets) - 1))
            f.write(np.asarray(self._offsets, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")
        _fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))
        return self.prefix

    def abort(self) -> None:
        """Discard everything written so far (temporary files are removed; PREFIX is untouched)."""
        self._done = True
        self._bin_file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, d in _DTYPES.items() if d == dtype)


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; documents are numpy views into a memory map (no copies).

    Args:
        prefix: path without extension.

    Raises:
        ValueError naming the file if it is missing, not a megatron-lite index, or truncated.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file (write PREFIX.bin/.idx with tools/preprocess_data.py)")
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER.size)
            if len(header) >= len(MAGIC) and header[: len(MAGIC)] != MAGIC:
                hint = " (a Megatron-LM MMIDIDX index; megatron-lite uses its own format: re-run " \
                       "tools/preprocess_data.py)" if header.startswith(_MEGATRON_MAGIC) else ""
                raise ValueError(f"{idx_path}: bad magic {header[:8]!r}, not a megatron-lite index{hint}")
            if len(header) < _HEADER.size:
                raise ValueError(f"{idx_path}: truncated header ({len(header)} of {_HEADER.size} bytes)")
            _, version, code, n_docs = _HEADER.unpack(header)
            if version != VERSION:
                raise ValueError(f"{idx_path}: unsupported version {version} (this code reads {VERSION})")
            if code not in _DTYPES:
                raise ValueError(f"{idx_path}: unknown dtype code {code}")
            expected = _HEADER.size + 8 * (n_docs + 1)
            actual = os.path.getsize(idx_path)
            if actual != expected:
                raise ValueError(
                    f"{idx_path}: truncated or corrupt: {actual} bytes, expected {expected} for {n_docs} documents"
                )
            # Start of every document in the token stream, then the total: n_docs + 1 entries.
            self.offsets = np.fromfile(f, dtype="<i8", count=n_docs + 1).astype(np.int64)
        if self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0):
            raise ValueError(f"{idx_path}: corrupt document offsets (must start at 0 and never decrease)")
        self.dtype = _DTYPES[code]
        self.sizes = np.diff(self.offsets)  # document lengths in tokens, int64
        self.num_tokens = int(self.offsets[-1])
        expected = self.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(
                f"{bin_path}: truncated or mismatched: {actual} bytes, but {idx_path} describes "
                f"{self.num_tokens} tokens of {self.dtype.name} ({expected} bytes)"
            )
        # np.memmap cannot map an empty file.
        self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens else np.empty(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        """Args: i, a document index (negative counts from the end). Returns: its tokens, a view."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents in {self.prefix}")
        i %= n
        return self._tokens[self.offsets[i]: self.offsets[i + 1]]

    def get_tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream, across document boundaries.

        Args:
            start: first token index (>= 0).
            length: number of tokens (>= 0).

        Returns:
            A view of `length` tokens.
        """
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise ValueError(
                f"token range [{start}, {start + length}) outside [0, {self.num_tokens}) of {self.prefix}"
            )
        return self._tokens[start: start + length]

    # Pickle by path, e.g. for DataLoader workers started with 'spawn': pickling the memmap would copy
    # the whole corpus into every worker.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])
