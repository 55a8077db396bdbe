"""The index arrays behind GPTDataset and BlendedDataset, computed exactly as megatron-core computes them.

Pure numpy functions of (sizes, counts, a `numpy.random.RandomState`); megatron-core builds the same arrays
partly in C++ (`helpers.cpp`), here `build_sample_index` and `build_blending_indices` are vectorised.
Equal inputs give equal arrays, element for element (tests/data/test_megatron_order.py pins them against
megatron-core 0.16.1). For one dataset of documents D and E epochs::

    document_index   E copies of D, shuffled (the last copy shuffled apart when separate_final_epoch)
                     e.g. D = [0 1 2], E = 2:   [2 0 1 1 0 2]
    token stream     the documents in document_index order, back to back
    sample_index     (num_samples + 1) x 2: row k = (position in document_index, token offset) of stream
                     position k x L; sample k is the stream's tokens [k L, (k + 1) L + extra)
    shuffle_index    a permutation of range(num_samples) (first epochs and the separate last one apart)

`extra` is add_extra_token_to_sequence (1: the sample holds L + 1 tokens, inputs and shifted labels).
"""

from typing import Optional, Tuple

import numpy as np

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
"""megatron-core shuffles the last epoch apart when less than this fraction of it is used."""


def num_epochs_for(num_samples: Optional[int], tokens_per_epoch: int, seq_length: int, extra: int) -> int:
    """Epochs needed to draw `num_samples` samples (one when None): megatron-core's `_get_num_epochs`."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(num_samples: Optional[int], num_epochs: int, tokens_per_epoch: int, seq_length: int,
                         extra: int) -> Tuple[bool, int]:
    """Whether the last epoch is shuffled apart, and the number of samples before it.

    The last epoch is separate when fewer than 80% of its samples are used (so the first epochs' samples
    are not diluted by a partial one). Returns (separate, samples in the first num_epochs - 1 epochs).
    """
    if num_epochs == 1:
        return False, 0
    before = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - before
    per_epoch = (tokens_per_epoch - extra) // seq_length
    if not 0 <= from_final <= per_epoch + 1:  # megatron-core asserts this; impossible for valid inputs
        raise ValueError(f"inconsistent epoch count: {from_final} samples from the final epoch of {per_epoch}")
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """`num_epochs` copies of `documents` (int32), shuffled together, or the first num_epochs - 1 copies
    and then the last one shuffled apart (two draws from `rng`, in that order)."""
    if separate_final and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate((first, build_document_index(documents, 1, rng, False)))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, extra: int = 1) -> np.ndarray:
    """Row k: (position in document_index, token offset) where sample k starts; num_samples + 1 rows, the
    last marking where the last sample ends (less `extra`). The last partial sample is dropped.

    A start on a document boundary is recorded as megatron-core's `build_sample_idx` records it: with
    extra = 1 as offset 0 of the next non-empty document, with extra = 0 as (previous document, its
    length). Row 0 is always (0, 0).

    Args:
        sizes: tokens per sequence of the whole indexed dataset.
        document_index: sequence ids in stream order (build_document_index).
        seq_length, num_epochs, tokens_per_epoch: as the dataset computed them.
        extra: add_extra_token_to_sequence, 0 or 1.

    Returns:
        int32 array [num_samples + 1, 2] (int64 when an index or a size exceeds int32, as megatron-core).
    """
    if seq_length < 2 or tokens_per_epoch < 2 or num_epochs < 1:  # megatron-core's asserts
        raise ValueError(f"need seq_length > 1, tokens_per_epoch > 1 and num_epochs > 0, got {seq_length}, "
                         f"{tokens_per_epoch}, {num_epochs}")
    num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    stream_starts = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64)[document_index], out=stream_starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # extra = 1: the document holding the position; extra = 0: the one that ends at or after it.
    rows = np.searchsorted(stream_starts, positions, side="right" if extra else "left") - 1
    rows[0] = 0
    offsets = positions - stream_starts[rows]
    dtype = np.int32 if max(len(document_index), int(np.max(sizes))) <= np.iinfo(np.int32).max else np.int64
    return np.stack((rows, offsets), axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A shuffled range(num_samples), followed by a separately shuffled range(num_samples, total_size)
    when that is not empty; uint32 (int64 for very large sizes), as megatron-core's `_build_shuffle_index`."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_blending_indices(weights, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """megatron-core's greedy blend: sample i comes from the dataset whose count lags its share the most.

    For i = 0..size-1 take d = argmax_j (weights[j] x max(i, 1) - count[j]), the first on ties, then
    count[d] += 1. The loop is plain Python floats, the same IEEE double arithmetic as helpers.cpp, so
    near-ties fall the same way (about 1 s per million samples; the result is cached).

    Args:
        weights: normalized weights (sum 1), one per dataset.
        size: samples to assign.

    Returns:
        (dataset_index int16 [size], dataset_sample_index int64 [size]): the dataset of each sample and
        its sample number within that dataset.
    """
    return _greedy([float(w) for w in weights], size, limits=None)


def build_exhaustive_blending_indices(sizes) -> Tuple[np.ndarray, np.ndarray]:
    """Exactly sizes[j] samples from dataset j, interleaved by the same greedy rule with weights
    sizes / sum(sizes), a dataset leaving the race once spent (megatron-core's unweighted blend)."""
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    return _greedy([n / float(total) for n in sizes], total, limits=sizes)


def _greedy(weights, size: int, limits) -> Tuple[np.ndarray, np.ndarray]:
    counts = [0] * len(weights)
    chosen = [0] * size
    sample = [0] * size
    candidates = range(len(weights))
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = -1, -float("inf")
        for j in candidates:
            error = weights[j] * x - counts[j]
            if error > best_error:  # strict: the first maximum wins, as in helpers.cpp
                best, best_error = j, error
        chosen[i], sample[i] = best, counts[best]
        counts[best] += 1
        if limits is not None and counts[best] == limits[best]:
            candidates = [j for j in candidates if j != best]
    return np.array(chosen, dtype=np.int16), np.array(sample, dtype=np.int64)
