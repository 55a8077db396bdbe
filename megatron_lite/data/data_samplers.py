"""Megatron's pretraining sampler: which global samples each data-parallel rank reads, and the data loader.

::

    micro-step s (consumed = c):   samples [c, c + mbs x dp)
    rank r takes                   [c + r x mbs, c + (r + 1) x mbs)
    then                           c += mbs x dp

Global sample indices are consumed in order, so the samples in a global batch do not depend on the
data-parallel size, and a resumed run continues at its consumed_samples. With num_workers > 0 a torch
DataLoader reads the samples in worker processes (Megatron's --num-workers); the batches are the same.
"""

from typing import Dict, Iterator, List

import torch


def _check(consumed_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int):
    if micro_batch_size < 1 or data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"bad micro_batch_size={micro_batch_size}, data_parallel_rank={data_parallel_rank}, "
                         f"data_parallel_size={data_parallel_size}")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack the samples' tensors key by key."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def get_batch_for_rank(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                       data_parallel_size: int) -> Dict[str, torch.Tensor]:
    """This rank's micro-batch of the micro-step that starts at global sample `consumed_samples`.

    Args:
        dataset: a GPTDataset, BlendedDataset or MockGPTDataset (anything indexable by sample index).
        consumed_samples: global samples consumed before this micro-step.
        micro_batch_size: samples per rank per micro-step.
        data_parallel_rank, data_parallel_size: this rank and the number of ranks.

    Returns:
        {'tokens', 'labels'}: int64 tensors [micro_batch_size, seq_length]; 'loss_mask' float32.
    """
    _check(consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
    start = consumed_samples + data_parallel_rank * micro_batch_size
    return collate([dataset[start + j] for j in range(micro_batch_size)])


class MegatronPretrainingSampler:
    """The index lists of this rank's micro-batches from `consumed_samples` until the dataset ends (a
    partial last micro-step is dropped); a batch_sampler for torch's DataLoader."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int):
        _check(consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.rank, self.step = micro_batch_size, data_parallel_rank, \
            micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return max(self.total_samples - self.consumed_samples, 0) // self.step

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples + self.rank * self.micro_batch_size
        for step in range(len(self)):
            first = start + step * self.step
            yield list(range(first, first + self.micro_batch_size))


def micro_batch_iterator(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                         data_parallel_size: int, num_workers: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's micro-batches, one micro-step after another, from global sample `consumed_samples` on.

    Args:
        num_workers: 0 reads in this process; more starts a torch DataLoader with that many worker
            processes (the same batches in the same order).
    """
    if num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                         data_parallel_size)
    if num_workers == 0:
        return (collate([dataset[i] for i in indices]) for indices in sampler)
    # A generator of its own: by default each iterator draws its workers' base seed from the process's torch
    # generator, shifting dropout after a resume (the iterator is made after the RNG state is restored).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate, generator=torch.Generator())
    return iter(loader)
