"""What a GPT data pipeline is built from: the blend(s), the split, the sequence length, the seed, the cache.

Megatron-LM's flags map onto it one to one::

    --data-path 0.3 A 0.7 B           blend = (["A", "B"], [0.3, 0.7])   one distribution, cut by --split
    --data-path A B                   blend = (["A", "B"], None)         weights = the datasets' sizes
    --train-data-path / --valid-data-path / --test-data-path   blend_per_split, --split unused
    --split 969,30,1                  split_matrix [(0, .969), (.969, .999), (.999, 1.0)]: document
                                      range [round(beg x n), round(end x n)) of each dataset's n documents

The rounding is megatron-core's (Python's round, halves to even, on the cumulative normalized weights),
not legacy Megatron's shift-to-fit; `split_documents` gives the ranges.
"""

import dataclasses
import functools
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

Blend = Tuple[List[str], Optional[List[float]]]
SPLIT_NAMES = ("train", "valid", "test")


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum in float64 (megatron-core's `normalize`, to the last bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def get_blend_from_list(values: Optional[Sequence[str]], flag: str = "--data-path") -> Optional[Blend]:
    """`PREFIX ...` or `WEIGHT PREFIX WEIGHT PREFIX ...` -> (prefixes, weights or None).

    A list without any number is unweighted. Otherwise weights and prefixes must alternate, each weight a
    finite number > 0 (megatron-core would read an odd-length list as prefixes only and fail later on a
    missing file '0.3.bin').

    Raises:
        ValueError naming `flag`.
    """
    if values is None:
        return None
    values = [v.strip() for v in values]
    if not values:
        raise ValueError(f"{flag} needs at least one dataset prefix")
    numbers = [_number(v) for v in values]
    if all(x is None for x in numbers):
        return values, None
    if len(values) % 2:
        raise ValueError(f"{flag} {' '.join(values)}: {len(values)} values, but weights and prefixes must come "
                         "in pairs ('0.3 A 0.7 B'), or give prefixes only ('A B')")
    weights = numbers[0::2]
    for position, (text, weight) in enumerate(zip(values[0::2], weights)):
        if weight is None:
            raise ValueError(f"{flag}: expected a weight at position {2 * position + 1}, got {text!r} "
                             "(weights and prefixes alternate: '0.3 A 0.7 B')")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{flag}: weight {text} for {values[2 * position + 1]} must be a finite number > 0")
    return values[1::2], weights


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> List[float]:
    """'969,30,1' (or '98/2/0', '100') -> the three normalized weights. The train weight must be > 0.

    Raises:
        ValueError naming --split.
    """
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers, e.g. '969,30,1'") from None
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--split {split!r}: expected 1 to 3 non-negative numbers, e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    if weights[0] <= 0:
        raise ValueError(f"--split {split!r}: the train weight must be positive")
    return normalize(weights)


def split_matrix(weights: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Normalized weights -> per split (begin, end) fractions, None for an empty one (cumulative sums in
    the order megatron-core adds them)."""
    bounds = functools.reduce(lambda acc, w: acc + [acc[-1] + w], weights, [0])
    return [(b, e) if e > b else None for b, e in zip(bounds[:-1], bounds[1:])]


def document_range(bookends: Tuple[float, float], num_docs: int) -> range:
    """A split's (begin, end) fractions -> documents [round(begin x n), round(end x n)) (megatron-core's rounding)."""
    begin, end = (int(round(b * float(num_docs))) for b in bookends)
    return range(begin, end)


def split_documents(num_docs: int, split: str) -> Tuple[range, range, range]:
    """`--split` applied to `num_docs` documents as megatron-core does: split i is documents
    [round(begin_i x n), round(end_i x n)). Ranges are contiguous and cover range(num_docs); a split with
    weight 0 is empty, and so may be one whose share rounds to no document.

    Raises:
        ValueError naming --split (a malformed value).
    """
    if num_docs < 1:
        raise ValueError(f"need at least one document to split, got {num_docs}")
    ranges = []
    for bookends in split_matrix(parse_split(split)):
        if bookends is None:
            start = ranges[-1].stop if ranges else 0
            ranges.append(range(start, start))
            continue
        ranges.append(document_range(bookends, num_docs))
    return tuple(ranges)


@dataclasses.dataclass
class GPTDatasetConfig:
    """How the GPT datasets are built (megatron-core's GPTDatasetConfig, the fields megatron-lite uses)."""

    random_seed: int
    """Seeds the document and sample shuffles (numpy RandomState), as --seed does in Megatron-LM."""

    sequence_length: int
    """Tokens per sample (the model's input length)."""

    blend: Optional[Blend] = None
    """(prefixes, weights or None): one distribution for all splits, cut by `split`."""

    blend_per_split: Optional[List[Optional[Blend]]] = None
    """A blend per split (train, valid, test), each None or (prefixes, weights or None); no `split`."""

    split: Optional[str] = None
    """Train, valid, test weights of each dataset's documents, with `blend`."""

    path_to_cache: Optional[str] = None
    """Directory for the index arrays (None: built in memory every time)."""

    mid_level_dataset_surplus: float = 0.005
    """Fraction of extra samples built per blended dataset, so the greedy blend never runs one dry."""

    add_extra_token_to_sequence: bool = True
    """Samples of sequence_length + 1 tokens (inputs and labels shifted by one); False: sequence_length
    tokens, the last label padding that has no loss."""

    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token `eod`."""

    eod: Optional[int] = None
    """The tokenizer's end-of-document id (needed with eod_mask_loss)."""

    vocab_size: Optional[int] = None
    """The tokenizer's vocabulary: every sample read must hold whole token ids in [0, vocab_size), else
    reading it raises ValueError naming the dataset and the sample (None: only the ids' sign and wholeness
    are checked). Ids between the tokenizer's vocabulary and the model's padded one would train on padding
    rows without any error."""

    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = dataclasses.field(init=False, default=None)
    """Derived from `split`: per split the (begin, end) fractions of each dataset's documents, or None."""

    def __post_init__(self):
        if self.sequence_length < 2:  # megatron-core's sample index needs two tokens per sample
            raise ValueError(f"sequence_length (--seq-length) must be >= 2, got {self.sequence_length}")
        if (self.blend is None) == (self.blend_per_split is None):
            raise ValueError("give exactly one of blend (--data-path) and blend_per_split (--train-data-path, "
                             "--valid-data-path, --test-data-path)")
        if self.blend is not None and self.split is None:
            raise ValueError("split (--split) is required with blend (--data-path)")
        if self.blend_per_split is not None and (len(self.blend_per_split) != 3 or self.blend_per_split[0] is None):
            raise ValueError("blend_per_split needs a train blend (--train-data-path) and three entries")
        if not self.mid_level_dataset_surplus >= 0:
            raise ValueError(f"mid_level_dataset_surplus must be >= 0, got {self.mid_level_dataset_surplus}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.eod_mask_loss and self.eod is None:
            raise ValueError("eod_mask_loss needs eod, the tokenizer's end-of-document id")
        self.split_matrix = split_matrix(parse_split(self.split)) if self.blend is not None else None
