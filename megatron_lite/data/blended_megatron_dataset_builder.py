"""Build the train, valid and test datasets of a GPTDatasetConfig, as megatron-core's
BlendedMegatronDatasetBuilder does, for the same sample counts.

::

    blend, one prefix, no weight     each split: GPTDataset(documents of the split, size of the split)
    blend with weights w_j           dataset j, split i: GPTDataset(.., ceil(ceil(size_i x w_j) x 1.005))
                                     split i: BlendedDataset(weights w, size sum_j ceil(size_i x w_j))
    blend without weights            dataset j: one epoch; split i: BlendedDataset(weights = the epochs'
                                     sample counts, size min(size_i, their sum))
    blend_per_split                  the same per split, each dataset's documents all in that split

A split with no documents (weight 0, or a share that rounds to none) is None, and so is a validation or test
split whose one epoch holds no sample; megatron-core would fail on these or loop forever. Every rank calls
`build_datasets`; pretrain_gpt.py runs it on rank 0 first so the others find the index caches written.
"""

import math
from typing import Dict, List, Optional, Sequence

from .blended_dataset import BlendedDataset
from .blended_megatron_dataset_config import SPLIT_NAMES, GPTDatasetConfig, document_range, normalize
from .gpt_dataset import GPTDataset, SplitTooSmallError
from .indexed_dataset import IndexedDataset

PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def build_datasets(config: GPTDatasetConfig, sizes: Sequence[Optional[int]],
                   left_out: Optional[Dict[str, str]] = None) -> List[Optional[object]]:
    """[train, valid, test]: a GPTDataset, a BlendedDataset, or None (no such split).

    Args:
        config: the blend(s), split, sequence length, seed and cache.
        sizes: samples wanted per split (None: one epoch of each dataset, unweighted blends only).
        left_out: if given, filled with {split name: why it is None} for each split left out.

    Raises:
        ValueError naming the flag (--data-path, --train-data-path, ...) for a missing or unreadable dataset,
        or a weighted blend without a size.
    """
    opened: Dict[str, IndexedDataset] = {}
    why: Dict[int, str] = {}
    if config.blend is not None:
        prefixes, weights = config.blend
        result = _build_distribution(prefixes, weights, config.split_matrix, list(sizes), config, opened,
                                     "--data-path", range(3), why)
    else:
        result = []
        for i, blend in enumerate(config.blend_per_split):
            if blend is None:
                why[i] = f"no {PER_SPLIT_FLAGS[i]} given"
                result.append(None)
                continue
            matrix, split_sizes, reasons = [None] * 3, [0] * 3, {}
            matrix[i], split_sizes[i] = (0.0, 1.0), sizes[i]
            result.append(_build_distribution(blend[0], blend[1], matrix, split_sizes, config, opened,
                                              PER_SPLIT_FLAGS[i], [i], reasons)[i])
            if i in reasons:
                why[i] = reasons[i]
    if left_out is not None:
        left_out.update({SPLIT_NAMES[i]: why.get(i, "no samples") for i, d in enumerate(result) if d is None})
    return result


def _build_distribution(prefixes, weights, matrix, sizes, config, opened, flag, wanted,
                        why) -> List[Optional[object]]:
    """The splits `wanted` of one distribution (prefixes with weights or None) cut by `matrix`; `why` gets
    the reason of each split left out."""
    if weights is not None:
        weights = normalize(weights)
    # megatron-core reads one prefix without a blend: with --data-path only when unweighted, per split always.
    if len(prefixes) == 1 and (weights is None or flag in PER_SPLIT_FLAGS):
        return _build_splits(prefixes[0], matrix, sizes, config, opened, flag, why)
    if weights is None:
        buffers = [[None] * 3 for _ in prefixes]
    else:
        if any(sizes[i] is None for i in wanted):
            raise ValueError(f"{flag}: a weighted blend needs the number of samples of every split")
        targets = _size_per_split_per_dataset(weights, sizes)
        buffers = _size_per_split_per_dataset(weights, sizes, config.mid_level_dataset_surplus)
    per_dataset = [_build_splits(p, matrix, buffers[j], config, opened, flag, why) for j, p in enumerate(prefixes)]
    result: List[Optional[object]] = [None] * 3
    for i in wanted:
        parts = [splits[i] for splits in per_dataset]
        if matrix[i] is None or any(part is None for part in parts):
            continue
        if weights is not None:
            result[i] = BlendedDataset(parts, weights, sum(t[i] for t in targets), config)
        else:
            lengths = [len(part) for part in parts]
            size = None if sizes[i] is None else min(sizes[i], sum(lengths))
            result[i] = BlendedDataset(parts, lengths, size, config)
    return result


def _build_splits(prefix: str, matrix, sizes, config: GPTDatasetConfig, opened, flag,
                  why) -> List[Optional[GPTDataset]]:
    """The GPTDataset of each split of one indexed dataset (document range [round(b n), round(e n))); the
    first reason a split is left out goes into `why`."""
    if prefix not in opened:
        try:
            opened[prefix] = IndexedDataset(prefix)
        except ValueError as e:
            raise ValueError(f"{flag} {prefix}: {e}") from None
    indexed = opened[prefix]
    datasets = []
    for i, bookends in enumerate(matrix):
        if bookends is None:
            why.setdefault(i, f"--split {config.split} gives it no documents")
            datasets.append(None)
            continue
        documents = document_range(bookends, len(indexed))
        if not len(documents):
            why.setdefault(i, f"{prefix} holds no documents" if flag in PER_SPLIT_FLAGS else
                           f"its share of --split {config.split} rounds to none of the {len(indexed)} documents "
                           f"of {prefix}")
            datasets.append(None)
            continue
        try:
            datasets.append(GPTDataset(indexed, documents, sizes[i], SPLIT_NAMES[i], config))
        except SplitTooSmallError as e:
            if i == 0:  # no training data is an error; a validation or test split too small is left out
                raise
            why.setdefault(i, str(e))
            datasets.append(None)
    return datasets


def _size_per_split_per_dataset(weights: Sequence[float], sizes: Sequence[Optional[int]], surplus: float = 0.0):
    """[dataset][split] samples: ceil(ceil(size x weight) x (1 + surplus)) (megatron-core's margin)."""
    return [[None if size is None else int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in sizes]
            for w in weights]
