"""Data: tokenizers, the indexed token dataset, GPT samples and the built-in corpus.

Text -> `tools/preprocess_data.py` (a tokenizer) -> PREFIX.bin/.idx (Megatron-LM's MMIDIDX, `IndexedDataset`) ->
`GPTDataset` (windows of seq_length + 1 tokens, shuffled per epoch) -> `get_batch_for_rank` /
`micro_batch_iterator`.
"""

from .corpus import builtin_corpus_documents, ensure_builtin_dataset, write_builtin_dataset
from .gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    build_gpt_datasets,
    get_batch_for_rank,
    micro_batch_iterator,
    split_documents,
)
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .tokenizer import build_tokenizer

__all__ = [
    "build_tokenizer",
    "IndexedDataset", "IndexedDatasetBuilder",
    "builtin_corpus_documents", "write_builtin_dataset", "ensure_builtin_dataset",
    "split_documents", "GPTDataset", "MockGPTDataset",
    "get_batch_for_rank", "micro_batch_iterator", "build_gpt_datasets",
]
