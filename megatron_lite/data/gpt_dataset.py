"""GPT training samples: fixed windows of a document range's token stream, shuffled per epoch.

::

    token stream of the split's documents (eod after each):  t0 t1 t2 ... t(N-1)
    sample k (seq_length L):   tokens = t[kL : kL+L]   labels = t[kL+1 : kL+L+1]
                               windows overlap by the one token that is both sample k's last label
                               and sample k+1's first input; the tail that cannot fill L+1 is dropped
    sample index i (any i >= 0):  epoch = i // len,  window = permutation_epoch[i % len]
                                  permutation_epoch = default_rng(seed + epoch).permutation(len)

Samples cross document boundaries, as in Megatron's GPTDataset: the eod token tells the model where a
document ends. `get_batch_for_rank` is Megatron's pretraining sampler: global sample indices are consumed
in order, each micro-step taking the next mbs x dp of them, so the samples in a global batch do not
depend on the data-parallel size.
"""

from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from .indexed_dataset import IndexedDataset


def split_documents(num_docs: int, split: str) -> Tuple[range, range, range]:
    """Megatron's `--split`: comma-separated weights -> contiguous train/valid/test document ranges.

    Weights are normalized to sum to 1 ('969,30,1', '98,2,0', '1/1/1' and '100' all work; missing
    weights are 0). Boundaries are rounded like Megatron's `get_train_valid_test_split_`: each split
    gets round(weight x num_docs), then every boundary moves by the same amount so the last one is
    num_docs. If that leaves the train split empty despite a positive weight it takes one document.

    Args:
        num_docs: number of documents (>= 1).
        split: the weights.

    Returns:
        (train, valid, test) ranges covering range(num_docs) in order.
    """
    if num_docs < 1:
        raise ValueError(f"need at least one document to split, got {num_docs}")
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers, e.g. '969,30,1'") from None
    if not 1 <= len(weights) <= 3 or any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--split {split!r}: expected 1 to 3 non-negative numbers, e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    if weights[0] <= 0:
        raise ValueError(f"--split {split!r}: the train weight must be positive")
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_docs)))
    diff = bounds[-1] - num_docs
    bounds = [0] + [b - diff for b in bounds[1:]]
    bounds[1] = max(bounds[1], 1)
    # Monotone and inside [0, num_docs] after the shift and the train minimum.
    for i in (2, 3):
        bounds[i] = min(max(bounds[i], bounds[i - 1]), num_docs)
    bounds[3] = num_docs
    return range(bounds[0], bounds[1]), range(bounds[1], bounds[2]), range(bounds[2], bounds[3])


class _EpochPermutations:
    """permutation(epoch) = default_rng(seed + epoch).permutation(n), the last two epochs cached."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self._cache = n, seed, {}

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.n)
        return self._cache[epoch]


def _sample(window: np.ndarray, eod_mask_token: Optional[int] = None) -> Dict[str, torch.Tensor]:
    window = torch.from_numpy(np.asarray(window, dtype=np.int64))
    tokens, labels = window[:-1], window[1:]
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    if eod_mask_token is not None:  # Megatron's --eod-mask-loss: no loss where the input is end-of-document
        loss_mask[tokens == eod_mask_token] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


class GPTDataset:
    """Shuffled windows of seq_length + 1 tokens over a contiguous range of documents.

    Args:
        indexed: the tokenized corpus.
        documents: contiguous document range (from `split_documents`).
        seq_length: tokens per sample (the model's context length).
        seed: shuffling seed; epoch e uses seed + e.
        eod_mask_token: the end-of-document id, to give the token after it a loss_mask of 0 (else all 1).
    """

    def __init__(self, indexed: IndexedDataset, documents: range, seq_length: int, seed: int,
                 eod_mask_token: Optional[int] = None):
        self.eod_mask_token = eod_mask_token
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        if not isinstance(documents, range) or documents.step != 1 or not (
                0 <= documents.start <= documents.stop <= len(indexed)):
            raise ValueError(f"documents must be a contiguous range inside [0, {len(indexed)}), got {documents}")
        self.indexed, self.documents, self.seq_length, self.seed = indexed, documents, seq_length, seed
        self.token_start = int(indexed.offsets[documents.start])
        self.num_tokens = int(indexed.offsets[documents.stop]) - self.token_start
        self.num_samples = max(self.num_tokens - 1, 0) // seq_length
        if self.num_samples == 0:
            raise ValueError(
                f"split too small for --seq-length {seq_length}: documents {documents.start}..{documents.stop - 1} "
                f"of {indexed.prefix} hold {self.num_tokens} tokens, a sample needs {seq_length + 1}"
            )
        self._permutation = _EpochPermutations(self.num_samples, seed)

    def __len__(self) -> int:
        """Samples in one epoch."""
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        """Args: i, any global sample index >= 0 (epochs repeat). Returns: {'tokens', 'labels'}, int64 [L], and
        'loss_mask', float32 [L]."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        epoch, position = divmod(int(i), self.num_samples)
        k = int(self._permutation(epoch)[position])
        start = self.token_start + k * self.seq_length
        return _sample(self.indexed.get_tokens(start, self.seq_length + 1), self.eod_mask_token)


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


def get_batch_for_rank(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                       data_parallel_size: int) -> Dict[str, torch.Tensor]:
    """This rank's micro-batch of the micro-step that starts at global sample `consumed_samples`.

    The micro-step covers samples [consumed, consumed + mbs x dp); rank r takes
    [consumed + r x mbs, consumed + (r + 1) x mbs). The trainer then advances consumed_samples by
    mbs x dp.

    Args:
        dataset: a GPTDataset or MockGPTDataset (anything indexable by sample index).
        consumed_samples: global samples consumed before this micro-step.
        micro_batch_size: samples per rank per micro-step.
        data_parallel_rank, data_parallel_size: this rank and the number of ranks.

    Returns:
        {'tokens', 'labels'}: int64 tensors [micro_batch_size, seq_length].
    """
    if micro_batch_size < 1 or data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"bad micro_batch_size={micro_batch_size}, data_parallel_rank={data_parallel_rank}, "
                         f"data_parallel_size={data_parallel_size}")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
    start = consumed_samples + data_parallel_rank * micro_batch_size
    samples = [dataset[start + j] for j in range(micro_batch_size)]
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def micro_batch_iterator(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                        data_parallel_size: int) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's micro-batches, one micro-step after another, from global sample `consumed_samples` on
    (the data iterator of Megatron's pretraining sampler; see get_batch_for_rank)."""
    while True:
        yield get_batch_for_rank(dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        consumed_samples += micro_batch_size * data_parallel_size


def build_gpt_datasets(data_prefix: Optional[str], mock: bool, split: str, seq_length: int, seed: int,
                       tokenizer, eod_mask_loss: bool = False):
    """The train and validation datasets for pretrain_gpt.py.

    Args:
        data_prefix: PREFIX of PREFIX.bin/.idx (ignored with mock).
        mock: synthetic data (MockGPTDataset) instead of a corpus.
        split: Megatron's --split weights; the test split is not built.
        seq_length: tokens per sample.
        seed: shuffling seed (mock: train uses seed, valid seed + 1).
        tokenizer: gives the vocabulary size for mock data, and the eod id.
        eod_mask_loss: no loss on the token after an end-of-document token.

    Returns:
        (train_ds, valid_ds); valid_ds is None when its split is empty.
    """
    if mock:
        return (MockGPTDataset(tokenizer.vocab_size, seq_length, seed),
                MockGPTDataset(tokenizer.vocab_size, seq_length, seed + 1))
    if not data_prefix:
        raise ValueError("give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    indexed = IndexedDataset(data_prefix)
    train_docs, valid_docs, _ = split_documents(len(indexed), split)
    eod = tokenizer.eod if eod_mask_loss else None
    train_ds = GPTDataset(indexed, train_docs, seq_length, seed, eod)
    valid_ds = GPTDataset(indexed, valid_docs, seq_length, seed, eod) if len(valid_docs) else None
    return train_ds, valid_ds
