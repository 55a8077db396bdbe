"""Samples drawn from several datasets in proportion to weights, in megatron-core's BlendedDataset order.

::

    weights 0.3 / 0.7:   dataset_index          0 1 1 0 1 1 1 0 1 1 ...   (greedy: the most lagging)
                         dataset_sample_index   0 0 1 1 2 3 4 2 5 6 ...   (k-th sample of that dataset)
    blend[i] = datasets[dataset_index[i]][dataset_sample_index[i]]

Each contributing GPTDataset is built with a few more samples than its share (the builder's surplus), so
the greedy rule never asks one for more than it holds.
"""

from typing import Dict, Optional, Sequence

import numpy as np
import torch

from . import helpers
from .blended_megatron_dataset_config import GPTDatasetConfig, normalize
from .index_cache import cached_indices


class BlendedDataset:
    """megatron-core's BlendedDataset over GPTDatasets of one split.

    Args:
        datasets: the contributing datasets (same split).
        weights: one per dataset, > 0; with `size` None they are exact sample counts.
        size: samples in the blend; None draws exactly weights[j] samples from dataset j.
        config: its path_to_cache is used.

    Raises:
        ValueError when the blend asks a dataset for more samples than it holds.
    """

    def __init__(self, datasets: Sequence, weights: Sequence, size: Optional[int], config: GPTDatasetConfig):
        if len(datasets) != len(weights) or not datasets or not all(w > 0 for w in weights):
            raise ValueError(f"a blend needs one weight > 0 per dataset, got {len(datasets)} datasets and "
                             f"weights {list(weights)}")
        self.datasets, self.size, self.config = list(datasets), size, config
        self.index_split = self.datasets[0].index_split
        self.seq_length = self.datasets[0].seq_length
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        description = {"class": "BlendedDataset",
                       "datasets": [d.cache_description for d in self.datasets],
                       "split": self.index_split, "weights": self.weights, "size": size}
        (self.dataset_index, self.dataset_sample_index), self.cache_hit = cached_indices(
            config.path_to_cache, description, f"BlendedDataset-{self.index_split}",
            ("dataset_index", "dataset_sample_index"), self._build_indices, self._check_indices)

    def _build_indices(self):
        if self.size is not None:
            dataset_index, sample_index = helpers.build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = helpers.build_exhaustive_blending_indices(self.weights)
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for j, (dataset, count) in enumerate(zip(self.datasets, counts.tolist())):
            if count > len(dataset):
                raise ValueError(f"the {self.index_split} blend asks {dataset.indexed.prefix} (number {j}) for "
                                 f"{count} samples, more than its {len(dataset)}: raise mid_level_dataset_surplus")
        return dataset_index, sample_index

    def _check_indices(self, arrays) -> Optional[str]:
        dataset_index, sample_index = arrays
        expected = self.size if self.size is not None else sum(self.weights)
        if dataset_index.shape != (expected,) or sample_index.shape != (expected,):
            return f"{dataset_index.shape} / {sample_index.shape} for {expected} samples"
        if expected and (dataset_index.max() >= len(self.datasets) or dataset_index.min() < 0):
            return "dataset_index names a dataset that is not in the blend"
        return None

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range: the {self.index_split} blend holds {len(self)} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
