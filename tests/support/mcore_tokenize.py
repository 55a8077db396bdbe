"""megatron-core 0.16.1's preprocessing, the reference of tests/data/test_megatron_tokenizers.py: each case's
JSON lines through megatron-core's tokenizer for that --tokenizer-type and its IndexedDatasetBuilder, as
Megatron-LM's tools/preprocess_data.py does (its Encoder.encode, --append-eod, one sequence per document).

    python mcore_tokenize.py CASES.json     CASES.json: [{"tokenizer_type", "tokenizer_model", "vocab_file",
                                            "merge_file", "input", "output_prefix"}, ...]

Prints one JSON line: [{"vocab_size", "eod"}, ...] in the cases' order.

The tokenizer is megatron.core.tokenizers' build_tokenizer(args) with Megatron-LM's defaults for the flags
preprocess_data.py does not set (no --legacy-tokenizer, no --tokenizer-hf-use-fast, ...). Except
GPT2BPETokenizer: megatron-core loads it as transformers' GPT-2 tokenizer named 'gpt2' on the Hugging Face Hub
(MegatronHFTokenizer, which downloads the name's files); here, offline, the same transformers tokenizer class is
given the case's vocab.json and merges.txt in a directory (its `tokenizer_dir`) through megatron-core's
HuggingFaceTokenizer, the class MegatronHFTokenizer is.

megatron-core's tokenizer and dataset modules need no CPU stubs; the script still runs in its own process, so the
test process never imports megatron-core.
"""

import argparse
import json
import sys


def mcore_args(case):
    """The argparse namespace megatron-core's build_tokenizer reads, at Megatron-LM's defaults."""
    return argparse.Namespace(
        tokenizer_type=case["tokenizer_type"], tokenizer_model=case.get("tokenizer_model"),
        vocab_file=case.get("vocab_file"), merge_file=case.get("merge_file"), vocab_size=None,
        tokenizer_metadata=None, tokenizer_special_tokens=None, tokenizer_sentencepiece_legacy=False,
        tokenizer_hf_use_fast=False, tokenizer_hf_include_special_tokens=False, trust_remote_code=False,
        tiktoken_pattern=None, tiktoken_num_special_tokens=1000)


def build(case):
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    if case["tokenizer_type"] == "GPT2BPETokenizer":
        return MegatronTokenizer.from_pretrained(tokenizer_path=case["tokenizer_dir"],
                                                 metadata_path={"library": "huggingface"}, use_fast=False,
                                                 additional_special_tokens=[])
    return build_tokenizer(mcore_args(case))


def preprocess(case):
    """Megatron-LM's Encoder.encode + Partition.process_json_file for one input, one json key 'text'."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = build(case)
    builder = IndexedDatasetBuilder(case["output_prefix"] + ".bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    with open(case["input"], encoding="utf-8") as f:
        for line in f:
            ids = tokenizer.tokenize(json.loads(line)["text"])
            lengths = [len(ids)] if ids else []
            if ids:  # --append-eod
                ids.append(tokenizer.eod)
                lengths[-1] += 1
            builder.add_document(ids, lengths)
    builder.finalize(case["output_prefix"] + ".idx")
    return {"vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print(json.dumps([preprocess(case) for case in cases]))
