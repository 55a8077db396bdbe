"""Data pipeline edge cases: preprocessing input that is odd but real, corpora with empty or one-token
documents, the index cache's key, and ids that are no token of the tokenizer (negative, NaN, fractions, beyond
its vocabulary).

Single process, CPU, a few seconds. The sample index is compared with a line-by-line Python transcription of
megatron-core's `build_sample_idx` (helpers.cpp) on corpora with empty documents, which the pinned fixture of
test_megatron_order.py does not hold.
"""

import json

import numpy as np
import pytest
from test_data import load_preprocess_module, write_dataset

from megatron_lite.data import GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, build_datasets, helpers
from megatron_lite.data.gpt_dataset import GPTDataset, SplitTooSmallError

EOD = 256  # ByteLevelTokenizer, preprocess_data.py's default


@pytest.fixture(scope="module")
def preprocess():
    return load_preprocess_module()


# ------------------------------------------------------------------------------------ tools/preprocess_data.py

def test_preprocess_skips_a_byte_order_mark(tmp_path, preprocess):
    """Would catch the UTF-8 byte order mark that Windows editors put at a file's start being tokenized as
    text (bytes EF BB BF at the start of the first document, silently), or refusing a .jsonl that has one."""
    text = "caf\u00e9 first\n\nsecond"
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "caf\u00e9"}).encode("utf-8") + b"\n")
    preprocess.main(["--input", str(tmp_path / "bom.txt"), str(tmp_path / "bom.jsonl"),
                     "--output-prefix", str(tmp_path / "out")])
    ds = IndexedDataset(str(tmp_path / "out"))
    assert [ds[i].tolist() for i in range(len(ds))] == [
        list("caf\u00e9 first".encode("utf-8")) + [EOD], list(b"second") + [EOD],
        list("caf\u00e9".encode("utf-8")) + [EOD]]


def test_preprocess_names_the_line_of_text_no_tokenizer_can_read(tmp_path, preprocess):
    """Would catch a bare UnicodeDecodeError / UnicodeEncodeError traceback (from the reader, or from a
    tokenizer worker) that names neither the file nor the line: for a .jsonl that is not UTF-8, and for a
    JSON string holding an unpaired surrogate escape; and a surrogate pair (an escaped emoji) refused."""
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl: not UTF-8"):
        preprocess.main(["--input", str(tmp_path / "latin1.jsonl"), "--output-prefix", str(tmp_path / "o")])
    (tmp_path / "lone.jsonl").write_text('{"text": "ok"}\n{"text": "half \\ud83d of an emoji"}\n')
    with pytest.raises(ValueError, match=r"lone\.jsonl:2: field 'text' holds an unpaired surrogate"):
        preprocess.main(["--input", str(tmp_path / "lone.jsonl"), "--output-prefix", str(tmp_path / "o")])
    assert not list(tmp_path.glob("o.*"))
    (tmp_path / "pair.jsonl").write_text('{"text": "\\ud83d\\ude00"}\n')
    preprocess.main(["--input", str(tmp_path / "pair.jsonl"), "--output-prefix", str(tmp_path / "pair")])
    assert IndexedDataset(str(tmp_path / "pair"))[0].tolist() == list("\U0001F600".encode("utf-8")) + [EOD]


# ------------------------------------------------------------------------------------------------ GPTDataset

def megatron_build_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, extra):
    """helpers.cpp's build_sample_idx (drop_last_partial_sequence), transcribed loop for loop."""
    num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[document_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            elif position == len(document_index) - 1:
                offset = int(sizes[document_index[position]]) - extra
                break
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


def test_sample_index_with_empty_and_one_token_documents_equals_megatron_core():
    """Would catch the vectorised sample index placing a sample start differently from megatron-core's loop
    where documents are empty (a dataset written by other tools may hold them) or one token long, a
    sample ends exactly on a document boundary, or add_extra_token_to_sequence is off."""
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(1500):
        sizes = rng.integers(0, 6, int(rng.integers(1, 9)))
        tokens_per_epoch = int(sizes.sum())
        num_epochs, seq_length, extra = int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(0, 2))
        if tokens_per_epoch < 2 or (num_epochs * tokens_per_epoch - extra) // seq_length < 1:
            continue
        document_index = np.tile(np.arange(len(sizes), dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        ours = helpers.build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, extra)
        theirs = megatron_build_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, extra)
        assert ours.tolist() == theirs.tolist(), (sizes[document_index].tolist(), seq_length, extra)
        compared += 1
    assert compared > 1000


def test_samples_read_across_empty_documents(tmp_path):
    """Would catch a sample that skips, repeats or stops at an empty document: with unique token values the
    samples of one epoch, in sample order, are exactly the overlapping windows of the non-empty stream."""
    documents = [[], [1, 2, 3], [], [], [4], [5, 6, 7, 8, 9], [], [10, 11]]
    prefix = write_dataset(tmp_path / "gaps", documents)
    config = GPTDatasetConfig(random_seed=3, sequence_length=3, blend=([prefix], None), split="100")
    train = build_datasets(config, [3, 0, 0])[0]
    stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents])
    by_sample = sorted(range(len(train)), key=lambda i: int(train.shuffle_index[i]))
    windows = [train[i]["tokens"].tolist() + train[i]["labels"][-1:].tolist() for i in by_sample]
    order = np.concatenate([np.asarray(documents[d], dtype=np.int64) for d in train.document_index])
    assert windows == [order[3 * k: 3 * k + 4].tolist() for k in range(len(train))]
    assert sorted(order.tolist()) == stream.tolist()


def test_one_token_split_without_the_extra_token(tmp_path):
    """Would catch a split of one token with add_extra_token_to_sequence off crashing the build with the
    sample index's bare 'tokens_per_epoch > 1' error: a validation split so small is left out (None), as
    with the extra token, and such a train split is SplitTooSmallError naming the split."""
    prefix = write_dataset(tmp_path / "t", [list(range(1, 10)) + [999]] * 9 + [[999]])
    for extra in (True, False):
        config = GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([prefix], None), split="9,1,0",
                                  add_extra_token_to_sequence=extra)
        train, valid, test = build_datasets(config, [5, 3, 0])
        assert len(train) >= 5 and valid is None and test is None
    one_token_first = write_dataset(tmp_path / "one", [[999]] + [list(range(1, 10)) + [999]] * 9)
    config = GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([one_token_first], None), split="1,9,0",
                              add_extra_token_to_sequence=False)
    with pytest.raises(SplitTooSmallError, match="train split too small"):
        build_datasets(config, [5, 3, 0])


# --------------------------------------------------------------------------------------------- the index cache

@pytest.mark.parametrize("change", ["sequence_length", "split", "extra_token", "num_samples", "surplus",
                                    "corpus_lengths"])
def test_cache_is_not_reused_when_the_indices_would_differ(tmp_path, change):
    """Would catch a cache key that leaves out something the indices depend on, so a run with another
    sequence length, split, extra-token setting, sample count, blend surplus, or a corpus rewritten under the
    same prefix silently trains on the indices built for the first run."""
    prefix = tmp_path / "c"
    write_dataset(prefix, [list(range(10 * i, 10 * i + 1 + i % 5)) + [999] for i in range(40)])
    kwargs = dict(random_seed=1, sequence_length=8, blend=([str(prefix), str(prefix)], [0.4, 0.6]), split="90,10,0",
                  path_to_cache=str(tmp_path / "cache"))
    sizes = [50, 5, 0]
    first = build_datasets(GPTDatasetConfig(**kwargs), sizes)[0]
    if change == "sequence_length":
        kwargs["sequence_length"] = 9
    elif change == "split":
        kwargs["split"] = "80,20,0"
    elif change == "extra_token":
        kwargs["add_extra_token_to_sequence"] = False
    elif change == "num_samples":
        sizes = [500, 5, 0]
    elif change == "surplus":
        kwargs["mid_level_dataset_surplus"] = 0.5
    else:
        write_dataset(prefix, [list(range(10 * i, 10 * i + 1 + i % 3)) + [999] for i in range(40)])
    second = build_datasets(GPTDatasetConfig(**kwargs), sizes)[0]
    assert not any(d.cache_hit for d in second.datasets), change
    rebuilt = build_datasets(GPTDatasetConfig(**kwargs), sizes)[0]  # the new key is then found
    assert all(d.cache_hit for d in rebuilt.datasets) and rebuilt.cache_hit
    assert first.datasets[0].cache_description != second.datasets[0].cache_description


# ------------------------------------------------------------------------------------ ids that are no token

def _dataset_with(tmp_path, dtype, value, vocab_size=None):
    """A 3-document dataset of `dtype` whose token 5 of sequence 1 is `value` (patched into the .bin: the
    builder refuses such ids), and its GPTDataset of one epoch (samples of 8 tokens, in stream order)."""
    prefix = str(tmp_path / f"ids_{np.dtype(dtype).name}")
    with IndexedDatasetBuilder(prefix, 1000, dtype=dtype) as builder:
        for d in range(3):
            builder.add_document(np.arange(20, dtype=np.int64) + 100 * d)
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r+")
    tokens[20 + 5] = value
    tokens.flush()
    del tokens
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None), split="1,0,0",
                              vocab_size=vocab_size)
    return GPTDataset(IndexedDataset(prefix), range(3), None, "train", config), prefix


def _sample_holding(dataset, value):
    for i in range(len(dataset)):
        try:
            dataset[i]
        except ValueError as e:
            return i, str(e)
    raise AssertionError(f"no sample holding {value} was refused")


@pytest.mark.parametrize("dtype, value, problem", [
    (np.int16, -3, "token id -3 is negative"),
    (np.int32, -1, "token id -1 is negative"),
    (np.float32, np.nan, "token id nan is not a number"),
    (np.float64, np.inf, "token id inf is not a number"),
    (np.float32, 2.5, "token id 2.5 is not a whole number"),
])
def test_ids_that_are_no_token_are_refused_naming_the_place(tmp_path, dtype, value, problem):
    """Would catch a negative id (or NaN in a float dataset, which becomes a huge negative int64) reaching the
    embedding as `IndexError: index out of range in self`, and a fractional id silently rounded down to
    another token."""
    dataset, prefix = _dataset_with(tmp_path, dtype, value)
    i, message = _sample_holding(dataset, value)
    assert message.startswith(f"{prefix}: {problem}") and "at token 5 of sequence 1" in message, message
    assert f"the train dataset's sample {i}" in message and "tools/preprocess_data.py" in message
    for k in range(len(dataset)):  # every other sample still reads
        if k != i:
            assert dataset[k]["tokens"].min() >= 0


def test_ids_beyond_the_tokenizers_vocabulary_are_refused(tmp_path):
    """NullTokenizer --vocab-size 1000 on ids up to 1023 (the model's padded vocabulary is 1024). Would catch
    the run training on the embedding's padding rows without a word; an id below the vocabulary still reads."""
    dataset, prefix = _dataset_with(tmp_path, np.uint16, 1023, vocab_size=1000)
    _, message = _sample_holding(dataset, 1023)
    assert "token id 1023 is not in the tokenizer's vocabulary of 1000" in message, message
    assert "--tokenizer-type, --tokenizer-model, --vocab-size" in message
    fits, _ = _dataset_with(tmp_path / "fits", np.uint16, 999, vocab_size=1000)
    assert max(int(fits[k]["labels"].max()) for k in range(len(fits))) == 999
