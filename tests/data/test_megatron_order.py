"""megatron-lite's GPT sample order against megatron-core 0.16.1's, from the pinned table
megatron_samples.json (written by pin_megatron_samples.py with megatron-core; this test does not need it).

For each case (one corpus or a blend, weighted or not, one distribution cut by --split or a blend per
split, several seeds and sequence lengths, a run of many epochs with and without a separate last epoch,
add_extra_token_to_sequence off, eod masking) every split must have megatron-core's length, and its first
samples must start and end at the same (document, offset), come from the same blended dataset, and hold
the same tokens, labels and loss masks. Single process, CPU, about a second.
"""

import json

import numpy as np
import pytest
from pin_megatron_samples import CASES, EOD, FIXTURE, _record_split, _resolve, write_corpora

from megatron_lite.data import GPTDatasetConfig, build_datasets, helpers, split_documents

with open(FIXTURE) as _f:
    PINNED = json.load(_f)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return write_corpora(str(tmp_path_factory.mktemp("corpora")))


def build_case(name, prefixes, cache=None):
    case = CASES[name]
    per_split = case.get("blend_per_split")
    config = GPTDatasetConfig(
        random_seed=case["seed"], sequence_length=case["seq_length"], blend=_resolve(case.get("blend"), prefixes),
        blend_per_split=None if per_split is None else [_resolve(b, prefixes) for b in per_split],
        split=case.get("split"), path_to_cache=cache, eod=EOD, eod_mask_loss=case.get("eod_mask_loss", False),
        add_extra_token_to_sequence=case.get("add_extra_token_to_sequence", True))
    return build_datasets(config, case["sizes"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_sample_order_equals_megatron_core(name, corpora):
    """Would catch any departure from megatron-core's order: a different shuffle (RandomState draws in
    another order, default_rng), the last epoch not shuffled apart below 80% (separate_final_epoch), a sample
    index that places a boundary start differently, the legacy --split rounding, blending weights not
    normalized twice or ties broken differently, a missing 0.5% surplus, or tokens read from the wrong
    documents."""
    expected = PINNED["cases"][name]
    for split, dataset in zip(("train", "valid", "test"), build_case(name, corpora)):
        got = _record_split(dataset, corpora)
        if expected[split] is None:
            assert got is None, split
            continue
        assert got["length"] == expected[split]["length"], split
        for i, (mine, theirs) in enumerate(zip(got["samples"], expected[split]["samples"])):
            assert mine == theirs, f"{split} sample {i}: (blend source, start doc, offset, end doc, offset)"
        assert len(got["samples"]) == len(expected[split]["samples"])
        assert got["md5"] == expected[split]["md5"], f"{split}: same offsets but other tokens/labels/loss mask"


def test_cases_cover_both_final_epoch_rules(corpora):
    """Would catch a fixture that never exercises one branch of separate_final_epoch (so the pinned
    comparison above could not see it break)."""
    seen = set()
    for name in CASES:
        for dataset in build_case(name, corpora):
            for gpt in getattr(dataset, "datasets", [dataset]):
                if gpt is not None and gpt.num_epochs > 1:
                    seen.add(helpers.separate_final_epoch(gpt.num_samples_requested, gpt.num_epochs,
                                                          gpt.tokens_per_epoch, gpt.seq_length, gpt.extra)[0])
    assert seen == {True, False}


@pytest.mark.parametrize("split", sorted(PINNED["split_documents"]))
def test_split_boundaries_equal_megatron_core(split):
    """Would catch legacy Megatron's rounding (each share rounded, then all boundaries shifted to fit),
    which moves boundaries by 1-2 documents for many corpus sizes, or rounding halves up instead of to
    even as Python's round does."""
    for n, expected in enumerate(PINNED["split_documents"][split], start=1):
        got = [[r.start, r.stop] if len(r) else None for r in split_documents(n, split)]
        # megatron-core has no range for a zero weight and an empty one when a share rounds to nothing.
        want = [None if e is None or e[0] == e[1] else e for e in expected]
        assert got == want, f"{n} documents, --split {split}"


def test_blending_indices_match_the_greedy_rule_at_scale():
    """Would catch a vectorised or reordered blend that drifts from the greedy rule over many samples:
    the proportions stay within one sample of weight x i at every prefix, and counts are consistent."""
    weights = [0.2, 0.5, 0.3]
    dataset_index, sample_index = helpers.build_blending_indices(weights, 10000)
    counts = np.zeros(3, dtype=np.int64)
    for i, d in enumerate(dataset_index.tolist()):
        assert sample_index[i] == counts[d]
        counts[d] += 1
        if i % 997 == 0:
            assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0 + 1e-9)
    assert np.all(np.abs(counts / 10000 - weights) < 0.01)
