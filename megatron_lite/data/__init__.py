"""Data: tokenizers, the indexed token dataset, GPT samples in megatron-core's order, blends, the sampler.

Text -> `tools/preprocess_data.py` (a tokenizer) -> PREFIX.bin/.idx (Megatron-LM's MMIDIDX, `IndexedDataset`) ->
`build_datasets` (`GPTDatasetConfig`: blend, split, seed; `GPTDataset` per dataset and split, `BlendedDataset`
over several; index arrays from `helpers`, cached by `index_cache`) -> `micro_batch_iterator` (Megatron's
pretraining sampler, optionally a DataLoader with workers).
"""

from .blended_dataset import BlendedDataset
from .blended_megatron_dataset_builder import build_datasets
from .blended_megatron_dataset_config import GPTDatasetConfig, get_blend_from_list, parse_split, split_documents
from .corpus import builtin_corpus_documents, ensure_builtin_dataset, write_builtin_dataset
from .data_samplers import MegatronPretrainingSampler, get_batch_for_rank, micro_batch_iterator
from .gpt_dataset import GPTDataset, MockGPTDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .tokenizer import build_tokenizer

__all__ = [
    "build_tokenizer",
    "IndexedDataset", "IndexedDatasetBuilder",
    "builtin_corpus_documents", "write_builtin_dataset", "ensure_builtin_dataset",
    "GPTDatasetConfig", "get_blend_from_list", "parse_split", "split_documents",
    "GPTDataset", "MockGPTDataset", "BlendedDataset", "build_datasets",
    "MegatronPretrainingSampler", "get_batch_for_rank", "micro_batch_iterator",
]
