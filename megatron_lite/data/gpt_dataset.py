"""GPT training samples in megatron-core's order: documents shuffled per epoch, cut into windows, shuffled.

::

    documents of the split, each epoch shuffled:   document_index = [d2 d0 d1 | d1 d0 d2 | ...]
    their tokens back to back (eod ends each):     t0 t1 t2 ... (stream)
    sample k (seq_length L):  stream[kL : kL + L + 1] -> tokens = first L, labels = last L
                              (windows overlap by one token; they cross document boundaries, the eod
                              token tells the model where a document ends)
    dataset[i] = sample shuffle_index[i]

The arrays (helpers.py) are megatron-core's GPTDataset's, element for element, for the same corpus, split,
sequence length, seed and number of samples: a run can move between megatron-lite and Megatron-LM without
seeing different data. They are cached under `config.path_to_cache` (index_cache.py). The number of
samples asked for decides the number of epochs and so the order: as in Megatron-LM, pretrain_gpt.py asks
for train_iters x global_batch_size training samples.
"""

from typing import Dict, Optional

import numpy as np
import torch

from . import helpers
from .blended_megatron_dataset_config import GPTDatasetConfig
from .index_cache import cached_indices
from .indexed_dataset import IndexedDataset

INDEX_FORMAT = 1
"""Bump when the cached arrays' meaning changes, so old caches are rebuilt."""


def _sample(text: np.ndarray, eod_mask_token: Optional[int] = None, extra: int = 1) -> Dict[str, torch.Tensor]:
    """text of L + extra tokens -> tokens, labels (shifted by one) and loss_mask. Without the extra token
    the last label is padding (0) with no loss, as in megatron-core."""
    text = torch.from_numpy(np.asarray(text, dtype=np.int64))
    if extra:
        tokens, labels = text[:-1], text[1:]
    else:
        tokens, labels = text, torch.roll(text, -1)
        labels[-1] = 0
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    if not extra:
        loss_mask[-1] = 0.0
    if eod_mask_token is not None:  # Megatron's --eod-mask-loss: no loss where the input is end-of-document
        loss_mask[tokens == eod_mask_token] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def _bad_ids(ids: np.ndarray, vocab_size: Optional[int]) -> np.ndarray:
    """True where `ids` holds no token id: negative, NaN / Inf or a fraction (float datasets), >= vocab_size."""
    bad = ids < 0
    if vocab_size is not None:
        bad |= ids >= vocab_size
    if ids.dtype.kind == "f":
        bad |= ~np.isfinite(ids) | (np.floor(ids) != ids)
    return bad


class SplitTooSmallError(ValueError):
    """A split whose documents hold too few tokens for one sample."""


class GPTDataset:
    """Samples of a contiguous range of an indexed dataset's documents, in megatron-core's order.

    Args:
        indexed: the tokenized corpus.
        documents: the contiguous document (sequence) range of this split (split_documents).
        num_samples: samples to provide at least (None: one epoch); the dataset holds whole epochs, so
            len() may be larger.
        index_split: 'train', 'valid' or 'test' (part of the cache name, as in megatron-core).
        config: sequence length, seed, cache directory, extra token, eod masking.

    Attributes:
        document_index, sample_index, shuffle_index: megatron-core's arrays (helpers.py's picture).
        num_epochs: epochs the samples span; cache_hit: whether the arrays were loaded from the cache.
    """

    def __init__(self, indexed: IndexedDataset, documents: range, num_samples: Optional[int], index_split: str,
                 config: GPTDatasetConfig):
        if not isinstance(documents, range) or documents.step != 1 or not (
                0 <= documents.start <= documents.stop <= len(indexed)):
            raise ValueError(f"documents must be a contiguous range inside [0, {len(indexed)}), got {documents}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.indexed, self.documents, self.num_samples_requested = indexed, documents, num_samples
        self.index_split, self.config, self.seq_length = index_split, config, config.sequence_length
        self.extra = int(config.add_extra_token_to_sequence)
        self.tokens_per_epoch = int(indexed.sizes[documents.start:documents.stop].sum())
        # tokens_per_epoch < 2: megatron-core's sample index asserts it (add_extra_token_to_sequence False).
        if self.tokens_per_epoch < 2 or self.tokens_per_epoch - self.extra < (
                self.seq_length if num_samples is None else 1):
            raise SplitTooSmallError(
                f"{index_split} split too small for --seq-length {self.seq_length}: documents {documents.start}.."
                f"{documents.stop - 1} of {indexed.prefix} hold {self.tokens_per_epoch} tokens")
        self.num_epochs = helpers.num_epochs_for(num_samples, self.tokens_per_epoch, self.seq_length, self.extra)
        description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "dataset_path": indexed.prefix,
            "sequence_lengths_md5": indexed.sequence_lengths_md5, "documents": [documents.start, documents.stop],
            "num_samples": num_samples, "index_split": index_split, "random_seed": config.random_seed,
            "sequence_length": self.seq_length, "split": config.split, "split_matrix": config.split_matrix,
            "add_extra_token_to_sequence": bool(self.extra),
        }
        self.cache_description = description
        names = ("document_index", "sample_index", "shuffle_index")
        arrays, self.cache_hit = cached_indices(config.path_to_cache, description, f"GPTDataset-{index_split}",
                                                names, self._build_indices, self._check_indices)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _expected_samples(self) -> int:
        return (self.num_epochs * self.tokens_per_epoch - self.extra) // self.seq_length

    def _build_indices(self):
        """megatron-core's GPTDataset._build_document_sample_shuffle_indices: one RandomState(seed) draws the
        document shuffle(s) and then the sample shuffle(s)."""
        separate, before_final = helpers.separate_final_epoch(
            self.num_samples_requested, self.num_epochs, self.tokens_per_epoch, self.seq_length, self.extra)
        rng = np.random.RandomState(self.config.random_seed)
        documents = np.arange(self.documents.start, self.documents.stop, dtype=np.int32)
        document_index = helpers.build_document_index(documents, self.num_epochs, rng, separate)
        sample_index = helpers.build_sample_index(self.indexed.sequence_lengths, document_index, self.seq_length,
                                                  self.num_epochs, self.tokens_per_epoch, self.extra)
        total = len(sample_index) - 1
        shuffle_index = helpers.build_shuffle_index(before_final if separate else total, total, rng)
        return document_index, sample_index, shuffle_index

    def _check_indices(self, arrays) -> Optional[str]:
        document_index, sample_index, shuffle_index = arrays
        samples = self._expected_samples()
        if document_index.shape != (self.num_epochs * len(self.documents),):
            return f"document_index has shape {document_index.shape}"
        if sample_index.shape != (samples + 1, 2) or shuffle_index.shape != (samples,):
            return f"sample_index {sample_index.shape} / shuffle_index {shuffle_index.shape} for {samples} samples"
        if len(document_index) and (document_index.min() < self.documents.start
                                    or document_index.max() >= self.documents.stop):
            return "document_index names documents outside the split"
        if samples and (shuffle_index.max() >= samples or sample_index[:, 0].max() >= len(document_index)):
            return "an index is out of range"
        return None

    def __len__(self) -> int:
        """Samples available (whole epochs: at least the number asked for)."""
        return len(self.sample_index) - 1

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        """Args: i, a sample index in [0, len). Returns: {'tokens', 'labels'}, int64 [L], and 'loss_mask',
        float32 [L]. Raises ValueError naming the sequence and the id when the sample holds an id that is no
        token of the tokenizer (negative, NaN, a fraction, >= config.vocab_size)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range: the {self.index_split} dataset holds {len(self)} samples")
        k = int(self.shuffle_index[i])
        (first, first_offset), (last, last_offset) = self.sample_index[k], self.sample_index[k + 1]
        first, first_offset, last, last_offset = int(first), int(first_offset), int(last), int(last_offset)
        sequences = [int(self.document_index[j]) for j in range(first, last + 1)]
        starts = [first_offset] + [0] * (last - first)
        if first == last:
            parts = [self.indexed[sequences[0]][first_offset:last_offset + self.extra]]
        else:
            parts = ([self.indexed[sequences[0]][first_offset:]] + [self.indexed[s] for s in sequences[1:-1]]
                     + [self.indexed[sequences[-1]][:last_offset + self.extra]])
        text = np.concatenate(parts)
        if _bad_ids(text, self.config.vocab_size).any():
            raise self._bad_ids_error(i, sequences, starts, parts)
        return _sample(text.astype(np.int64), self.config.eod if self.config.eod_mask_loss else None, self.extra)

    def _bad_ids_error(self, i: int, sequences, starts, parts) -> ValueError:
        """The first id of sample i that is not a token id of the run's tokenizer, named with its place."""
        vocab_size = self.config.vocab_size
        for sequence, start, part in zip(sequences, starts, parts):
            bad = np.flatnonzero(_bad_ids(part, vocab_size))
            if bad.size:
                value = part[bad[0]].item()
                break
        if isinstance(value, float) and not np.isfinite(value):
            problem = f"{value} is not a number (a damaged file, or values that are not token ids)"
        elif isinstance(value, float) and value != np.floor(value):
            problem = f"{value} is not a whole number (the float ids would be rounded down to other tokens)"
        elif value < 0:
            problem = f"{value} is negative"
        else:
            problem = (f"{value} is not in the tokenizer's vocabulary of {vocab_size} (the ids above it up to the "
                       "padded vocabulary would train on the embedding's padding rows)")
        return ValueError(
            f"{self.indexed.prefix}: token id {problem}, at token {start + int(bad[0])} of sequence {sequence} "
            f"(the {self.index_split} dataset's sample {i}): give the run the tokenizer the dataset was made with "
            f"(--tokenizer-type, --tokenizer-model, --vocab-size), or remake the dataset with "
            f"tools/preprocess_data.py and this run's tokenizer")


class MockGPTDataset:
    """Synthetic, learnable data for `--mock-data`: each sample is an arithmetic progression.

    Sample i is t_j = (a + d x j) mod (vocab_size - 1), j = 0..seq_length, with start a uniform and
    step d uniform in 1..MAX_STEP, both from default_rng([seed, i]); eod = vocab_size - 1
    (NullTokenizer's) never occurs. It is learnable in two stages: the successor of a token is one of
    MAX_STEP values (a bigram model reaches ln(MAX_STEP) ~ 1.39), and the previous two tokens give d
    (with attention the loss goes towards ln(MAX_STEP) / seq_length). On a 2-layer, 64-wide model with
    vocab 1024 and seq_length 64 the loss fell from 7.1 to 1.7 in 100 steps and 0.1 in 600.
    Megatron's mock data, uniform random tokens, stays at ln(vocab_size) forever.

    Args:
        vocab_size: token ids are in [0, vocab_size - 1) (>= 2).
        seq_length: tokens per sample.
        seed: base seed (train and valid use different ones; the distribution is the same).
    """

    MAX_STEP = 4

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        if vocab_size < 2 or seq_length < 1:
            raise ValueError(f"need vocab_size >= 2 and seq_length >= 1, got {vocab_size}, {seq_length}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 2**31  # unbounded in fact; a finite number for code that asks

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        """Args: i, any sample index >= 0. Returns: {'tokens', 'labels'}, int64 [seq_length], 'loss_mask' (ones)."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        rng = np.random.default_rng([self.seed, int(i)])
        start = int(rng.integers(0, self.vocab_size - 1))
        step = int(rng.integers(1, self.MAX_STEP + 1))
        return _sample((start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % (self.vocab_size - 1))
