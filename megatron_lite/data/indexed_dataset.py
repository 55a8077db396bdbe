"""A memory-mapped token dataset in Megatron-LM's MMIDIDX format: PREFIX.bin (tokens), PREFIX.idx (index).

::

    PREFIX.bin   | seq 0 tokens | seq 1 tokens | ... | seq n-1 tokens |    raw ids, little-endian, dtype below
                 ^0             ^pointers[1]   ^pointers[2]                 (pointers are in bytes)

    PREFIX.idx   | "MMIDIDX\\0\\0" | version u64 = 1 | dtype code u8 | n u64 | d u64 |     34-byte header
                 | sequence_lengths:  n x int32, in tokens                       |
                 | sequence_pointers: n x int64, byte offset of each sequence in the .bin |
                 | document_indices:  d x int64, 0 first and n last: document k is
                 |                    sequences [document_indices[k], document_indices[k+1])  |
                 | (sequence_modes:   n x int8, multimodal datasets only; skipped here)  |

    dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16

This is the layout megatron-core's `IndexedDataset` reads and `IndexedDatasetBuilder` writes, so a dataset
made by Megatron-LM's `tools/preprocess_data.py` trains here as is, and megatron-core reads ours. As in
megatron-core's GPTDataset, a *sequence* is the unit of training data: `len(dataset)` counts sequences,
`dataset[i]` is sequence i, and `--split` divides sequences. Without sentence splitting (the default of
both preprocessing tools) every document is one sequence. Sequences are stored back to back, so the
corpus is one concatenated token stream (`get_tokens`); an index whose pointers leave gaps is rejected.

The builder writes both files under temporary names and renames them into place, the .idx last, so a
reader never sees a half-written dataset; every reader checks that the two files agree in size.
"""

import functools
import hashlib
import os
import struct
import uuid
from typing import Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPES = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
"""Megatron-LM's dtype code -> the on-disk dtype of the token ids."""
_OLD_MEGATRON_LITE_MAGIC = b"MLITEIDX"  # megatron-lite's own format before it adopted MMIDIDX


def dtype_for_vocab_size(vocab_size: int) -> np.dtype:
    """Args: vocab_size. Returns: uint16 when every id fits with room to spare (< 65500), else int32
    (megatron-core's choice, `DType.optimal_dtype`)."""
    return DTYPES[8] if vocab_size < 65500 else DTYPES[4]


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if candidate == dtype:
            return code
    names = ", ".join(d.name for d in DTYPES.values())
    raise ValueError(f"dtype {np.dtype(dtype).name} has no MMIDIDX code; use one of {names}")


def _largest_exact_id(dtype: np.dtype) -> int:
    """The largest token id `dtype` stores exactly (floats: every integer up to 2**(mantissa bits + 1))."""
    if np.issubdtype(dtype, np.integer):
        return int(np.iinfo(dtype).max)
    return 2 ** (np.finfo(dtype).nmant + 1)


def _token_offsets(lengths: np.ndarray) -> np.ndarray:
    """n + 1 int64 offsets: sequence i is tokens [offsets[i], offsets[i + 1]) of the back-to-back stream."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, dtype=np.int64, out=offsets[1:])
    return offsets


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
    """Appends documents to PREFIX.bin/.idx (MMIDIDX); nothing is visible under PREFIX until `finalize()`.

    Usable as a context manager: a normal exit finalizes, an exception deletes the temporary files.

    Args:
        prefix: output path without extension (its directory is created if needed).
        vocab_size: every token id must be in [0, vocab_size).
        dtype: the on-disk dtype, one of `DTYPES` (default: `dtype_for_vocab_size(vocab_size)`); it must
            hold every id below vocab_size exactly.
    """

    def __init__(self, prefix: str, vocab_size: int, dtype=None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab_size(vocab_size) if dtype is None else DTYPES[_dtype_code(dtype)]
        if vocab_size - 1 > _largest_exact_id(self.dtype):
            raise ValueError(f"dtype {self.dtype.name} cannot hold token ids up to {vocab_size - 1} "
                             f"(vocab_size {vocab_size}); leave dtype out to choose one that can")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        # Unique temporary names in the same directory (so os.replace is an atomic rename): concurrent
        # builders of the same prefix never write into each other's files.
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = prefix + ".bin" + tag
        self._idx_tmp = prefix + ".idx" + tag
        self._bin_file = open(self._bin_tmp, "wb")
        self._sequence_lengths = []
        self._document_indices = [0]
        self._num_tokens = 0
        self._done = False

    def add_document(self, ids: Sequence[int], sequence_lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document.

        Args:
            ids: its token ids (a list or a 1-D integer array; may be empty), eod included if wanted.
            sequence_lengths: how `ids` divides into sequences (e.g. sentences), summing to len(ids);
                default one sequence, which is what GPT preprocessing writes.
        """
        if self._done:
            raise ValueError(f"{self.prefix}: add_document after finalize()/abort()")
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        lengths = [int(array.size)] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if any(n < 0 or n > np.iinfo(np.int32).max for n in lengths) or sum(lengths) != array.size:
            raise ValueError(f"sequence_lengths {lengths} must be in [0, 2**31) and sum to the document's "
                             f"{array.size} tokens (document {self.num_documents} of {self.prefix})")
        if array.size:
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.vocab_size:
                # Without this check an id >= 65536 would silently wrap around in uint16.
                raise ValueError(
                    f"token id {low if low < 0 else high} out of range [0, {self.vocab_size}) "
                    f"(document {self.num_documents} of {self.prefix})"
                )
            self._bin_file.write(array.astype(self.dtype, copy=False).tobytes())
        self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))
        self._num_tokens += int(array.size)

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
        lengths = np.asarray(self._sequence_lengths, dtype="<i4")
        pointers = (_token_offsets(lengths)[:-1] * self.dtype.itemsize).astype("<i8", copy=False)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(lengths),
                                 len(self._document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._document_indices, dtype="<i8").tobytes())
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
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def _read_index(prefix: str):
    """Parse and check PREFIX.idx. Returns: (dtype, sequence_lengths int32, sequence_pointers int64,
    document_indices int64), the arrays read into memory, and offsets, the n + 1 int64 token offsets of the
    sequences in the stream (the pointers are checked against them)."""
    idx_path = prefix + ".idx"
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER.size)
        if header.startswith(_OLD_MEGATRON_LITE_MAGIC):
            raise ValueError(
                f"{idx_path}: written in megatron-lite's old format (magic {_OLD_MEGATRON_LITE_MAGIC!r}); "
                f"megatron-lite now reads and writes Megatron-LM's MMIDIDX format: regenerate the dataset "
                f"with `python tools/preprocess_data.py --input YOUR_TEXT --output-prefix {prefix}`")
        if len(header) >= len(MAGIC) and header[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path}: bad magic {header[:len(MAGIC)]!r}, not a Megatron-LM MMIDIDX index "
                             f"(write PREFIX.bin/.idx with tools/preprocess_data.py)")
        if len(header) < _HEADER.size:
            raise ValueError(f"{idx_path}: truncated header ({len(header)} of {_HEADER.size} bytes)")
        _, version, code, n, d = _HEADER.unpack(header)
        if version != VERSION:
            raise ValueError(f"{idx_path}: unsupported MMIDIDX version {version} (this code reads {VERSION})")
        if code not in DTYPES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        expected = _HEADER.size + 12 * n + 8 * d
        actual = os.path.getsize(idx_path)
        if actual not in (expected, expected + n):  # + n: the int8 sequence modes of a multimodal dataset
            raise ValueError(f"{idx_path}: truncated or corrupt: {actual} bytes, expected {expected} for "
                             f"{n} sequences and {d} document indices")
        lengths = np.fromfile(f, dtype="<i4", count=n).astype(np.int32, copy=False)
        pointers = np.fromfile(f, dtype="<i8", count=n).astype(np.int64, copy=False)
        document_indices = np.fromfile(f, dtype="<i8", count=d).astype(np.int64, copy=False)
    if d < 1 or document_indices[0] != 0 or document_indices[-1] != n or np.any(np.diff(document_indices) < 0):
        raise ValueError(f"{idx_path}: corrupt document indices (must start at 0, never decrease, end at {n})")
    if np.any(lengths < 0):
        raise ValueError(f"{idx_path}: corrupt sequence lengths (negative)")
    dtype = DTYPES[code]
    offsets = _token_offsets(lengths)
    if not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise ValueError(f"{idx_path}: sequence pointers leave gaps or overlap in the .bin; megatron-lite reads "
                         f"sequences stored back to back (what Megatron-LM's preprocessing writes)")
    return dtype, lengths, pointers, document_indices, offsets


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx; sequences are numpy views into a memory map (no copies).

    Attributes:
        dtype: the token ids' on-disk dtype.
        sequence_lengths, sequence_pointers, document_indices: the index, as stored (see the module picture).
        offsets: n + 1 int64 token offsets, sequence i is tokens [offsets[i], offsets[i + 1]) of the stream.
        sizes: the sequence lengths as int64; num_tokens: the stream's length.

    Args:
        prefix: path without extension.

    Raises:
        ValueError naming the file if it is missing, not an MMIDIDX index (an old megatron-lite one is
        named as such, with the command that regenerates it), or truncated.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file (write PREFIX.bin/.idx with tools/preprocess_data.py)")
        (self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices,
         self.offsets) = _read_index(prefix)
        self.sizes = np.diff(self.offsets)  # sequence lengths in tokens, int64
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
        """The number of sequences (megatron-core's `len(IndexedDataset)`)."""
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @functools.cached_property
    def sequence_lengths_md5(self) -> str:
        """md5 of the int32 sequence lengths (what GPTDataset's cached indices depend on), computed once."""
        lengths = np.ascontiguousarray(self.sequence_lengths, dtype=np.int32)
        return hashlib.md5(lengths.tobytes(), usedforsecurity=False).hexdigest()

    def __getitem__(self, i: int) -> np.ndarray:
        """Args: i, a sequence index (negative counts from the end). Returns: its tokens, a view."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        return self._tokens[self.offsets[i]: self.offsets[i + 1]]

    def get_tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream, across sequence boundaries.

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
