"""Pin megatron-core's GPT sample order: writes tests/data/megatron_samples.json, the fixture that
test_megatron_order.py compares megatron-lite against (that test does not need megatron-core).

Run it where megatron-core's dataset code works (its wheel ships the compiled helpers; no GPU needed):

    pip download megatron-core==0.16.1 --no-deps -d /tmp/mcore && unzip -q /tmp/mcore/*.whl -d /tmp/mcore/pkg
    PYTHONPATH=/tmp/mcore/pkg python tests/data/pin_megatron_samples.py

For each case below it builds two small deterministic corpora (`write_corpora`, shared with the test),
runs megatron-core's BlendedMegatronDatasetBuilder with the case's config and sizes, and records per split
the dataset length and, for the first samples, where each starts and ends (document id, token offset)
and which blended dataset it came from, plus an md5 of the samples' tokens, labels and loss masks. It
also records the document ranges --split gives for many corpus sizes (megatron-core's rounding).
"""

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_samples.json")
VOCAB_SIZE, EOD = 1000, 999
PINNED = 320  # samples recorded per split
SPLIT_CORPUS_SIZES = 301  # --split's document ranges are recorded for 1..300 documents
SPLITS = ("969,30,1", "98,2,0", "1,1,1", "3,3,1", "90,5,5", "100", "0.5,0.3,0.2", "7,2,1", "99.9,0.1")


def _lengths(count: int, seed: int, longest: int):
    """Document lengths from a fixed linear congruential sequence (no library RNG: stable forever)."""
    x, lengths = seed, []
    for _ in range(count):
        x = (1103515245 * x + 12345) % 2**31
        lengths.append(1 + (x >> 8) % longest)
    return lengths


def write_corpora(directory: str):
    """Corpus A (60 documents, 1..120 tokens) and B (37 documents, 1..200 tokens), MMIDIDX, written with
    megatron-lite's builder; token j of document d is (7 d + j) mod 999, each document ends with EOD."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from megatron_lite.data import IndexedDatasetBuilder

    prefixes = []
    for name, count, seed, longest in (("A", 60, 11, 120), ("B", 37, 5, 200)):
        prefix = os.path.join(directory, name)
        with IndexedDatasetBuilder(prefix, VOCAB_SIZE) as builder:
            for d, length in enumerate(_lengths(count, seed, longest)):
                builder.add_document([(7 * d + j) % EOD for j in range(length - 1)] + [EOD])
        prefixes.append(prefix)
    return prefixes


# Every split of every case holds documents: megatron-core loops forever on an empty split (test_megatron_order
# checks that megatron-lite gives None there instead).
# name -> blend / blend_per_split over corpora "A", "B", the split, sizes, seed, sequence length, options
CASES = {
    "single": dict(blend=(["A"], None), split="90,7,3", sizes=[320, 96, 32], seed=1234, seq_length=32),
    "single_seed7_seq17": dict(blend=(["A"], None), split="90,5,5", sizes=[700, 40, 20], seed=7, seq_length=17),
    "one_epoch": dict(blend=(["B"], None), split="98,2,0", sizes=[100, 10, 0], seed=1234, seq_length=64),
    "no_extra_token_eod_mask": dict(blend=(["A"], None), split="85,10,5", sizes=[300, 50, 10], seed=3,
                                    seq_length=16, add_extra_token_to_sequence=False, eod_mask_loss=True),
    "blend_0.3_0.7": dict(blend=(["A", "B"], [0.3, 0.7]), split="90,8,2", sizes=[400, 48, 16], seed=1234,
                          seq_length=32),
    "blend_unweighted": dict(blend=(["A", "B"], None), split="80,15,5", sizes=[300, 64, 8], seed=99,
                             seq_length=24),
    "blend_single_weighted": dict(blend=(["B"], [1.0]), split="70,20,10", sizes=[200, 32, 8], seed=5,
                                  seq_length=32),
    "per_split": dict(blend_per_split=[(["A", "B"], [1.0, 2.0]), (["B"], None), None], sizes=[360, 40, 8],
                      seed=1234, seq_length=32),
    "per_split_unweighted": dict(blend_per_split=[(["B", "A"], None), (["A", "B"], [3.0, 1.0]), (["A"], None)],
                                 sizes=[250, 30, 12], seed=2, seq_length=20),
}


def _resolve(blend, prefixes):
    by_name = dict(zip("AB", prefixes))
    return None if blend is None else ([by_name[p] for p in blend[0]], blend[1])


def _record_split(dataset, prefixes):
    """Length, per pinned sample (blended dataset id or -1, start doc, start offset, end doc, end offset),
    md5 of tokens + labels + loss masks."""
    if dataset is None:
        return None
    rows, digest = [], hashlib.md5()
    for i in range(min(PINNED, len(dataset))):
        source, inner = -1, dataset
        j = i
        if hasattr(dataset, "dataset_index"):  # BlendedDataset
            source = int(dataset.dataset_index[i])
            inner, j = dataset.datasets[source], int(dataset.dataset_sample_index[i])
        k = int(inner.shuffle_index[j])
        (b, bo), (e, eo) = inner.sample_index[k], inner.sample_index[k + 1]
        rows.append([source, int(inner.document_index[b]), int(bo), int(inner.document_index[e]), int(eo)])
        sample = dataset[i]
        for key in ("tokens", "labels", "loss_mask"):
            digest.update(np.ascontiguousarray(sample[key].numpy().astype(np.float64)).tobytes())
    return {"length": len(dataset), "samples": rows, "md5": digest.hexdigest()}


def main():
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:  # what GPTDataset asks of a tokenizer; no pad token (megatron-core then pads with -1)
        vocab_size, eod, unique_identifiers = VOCAB_SIZE, EOD, {"class": "pin_megatron_samples.Tokenizer"}

    import megatron.core
    fixture = {"megatron_core": getattr(megatron.core, "__version__", "?"), "vocab_size": VOCAB_SIZE, "eod": EOD,
               "cases": {}, "split_documents": {}}
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        prefixes = write_corpora(tmp)
        for name, case in CASES.items():
            per_split = case.get("blend_per_split")
            config = GPTDatasetConfig(
                random_seed=case["seed"], sequence_length=case["seq_length"],
                blend=_resolve(case.get("blend"), prefixes),
                blend_per_split=None if per_split is None else [_resolve(b, prefixes) for b in per_split],
                split=case.get("split"), path_to_cache=os.path.join(tmp, "cache-" + name), tokenizer=Tokenizer(),
                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=case.get("eod_mask_loss", False),
                add_extra_token_to_sequence=case.get("add_extra_token_to_sequence", True))
            datasets = BlendedMegatronDatasetBuilder(GPTDataset, case["sizes"], lambda: True, config).build()
            fixture["cases"][name] = {split: _record_split(ds, prefixes)
                                      for split, ds in zip(("train", "valid", "test"), datasets)}
            print(name, {s: (r or {}).get("length") for s, r in fixture["cases"][name].items()})
        torch.distributed.destroy_process_group()
    # The builder's rounding of each split's bookends (BlendedMegatronDatasetBuilder._build_megatron_dataset_splits).
    for split in SPLITS:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        fixture["split_documents"][split] = [
            [None if m is None else [int(round(m[0] * float(n))), int(round(m[1] * float(n)))] for m in matrix]
            for n in range(1, SPLIT_CORPUS_SIZES)]
    with open(FIXTURE, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {FIXTURE} ({os.path.getsize(FIXTURE)} bytes)")


if __name__ == "__main__":
    main()
