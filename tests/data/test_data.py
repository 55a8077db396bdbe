"""Data pipeline: tokenizers, the indexed dataset, the built-in corpus, GPT samples and the DP sampler.

Single process, CPU, a few seconds. Token values in the GPTDataset tests are unique, so a window's
first token says exactly where in the stream it came from.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from pretrain_testing import REPO

from megatron_lite.data import (
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockGPTDataset,
    build_datasets,
    build_tokenizer,
    builtin_corpus_documents,
    ensure_builtin_dataset,
    get_batch_for_rank,
    split_documents,
    write_builtin_dataset,
)

PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")
EOD = 256  # ByteLevelTokenizer


def load_preprocess_module():
    spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_dataset(prefix, documents, vocab_size=1000):
    with IndexedDatasetBuilder(str(prefix), vocab_size) as builder:
        for doc in documents:
            builder.add_document(doc)
    return str(prefix)


@pytest.fixture(scope="module")
def corpus():
    return builtin_corpus_documents()


# ----------------------------------------------------------------------------------------------- tokenizers

def test_byte_level_round_trip_and_eod():
    """Catches a tokenizer that is not UTF-8 exact (non-ASCII mangled) or leaks eod into the text."""
    tok = build_tokenizer("ByteLevelTokenizer")
    text = "Grüße aus 東京 🚀\n\ttabs"
    ids = tok.tokenize(text)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == text
    # A window cut through a multi-byte character, or a padded-vocabulary id, decodes without raising.
    assert tok.detokenize(ids[:-1] + [300]).endswith("\ufffd")


def test_tokenizer_errors(monkeypatch, tmp_path):
    """Catches silent fallbacks: an unknown type, a missing optional package or tokenizer file, or a
    NullTokenizer that pretends to read text must each fail with a clear message."""
    with pytest.raises(ValueError, match="ByteLevelTokenizer.*HuggingFaceTokenizer.*NullTokenizer"):
        build_tokenizer("BertWordPieceCase")  # a Megatron type megatron-lite lacks
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="no such file"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.json").write_text("{}")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
        with pytest.raises(ValueError, match="pip install tokenizers"):
            build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod) == (100, 99)
    with pytest.raises(NotImplementedError, match="mock"):
        null.tokenize("text")


def test_huggingface_tokenizer(tmp_path):
    """Catches a wrong eod (an existing '<|endoftext|>' ignored, or a new id colliding with a real one)
    and special tokens added to every document."""
    tokenizers = pytest.importorskip("tokenizers")
    for special, expect_new_eod in ((["<|endoftext|>"], False), ([], True)):
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=300, special_tokens=special,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(["the quick brown fox", "Grüße aus 東京"] * 20, trainer)
        path = str(tmp_path / f"tokenizer{len(special)}.json")
        tokenizer.save(path)
        tok = build_tokenizer("HuggingFaceTokenizer", path)
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        if expect_new_eod:
            assert (tok.eod, tok.vocab_size) == (n, n + 1)
        else:
            assert (tok.eod, tok.vocab_size) == (tokenizer.token_to_id("<|endoftext|>"), n)
        ids = tok.tokenize("the quick Grüße")
        assert tok.eod not in ids and max(ids) < tok.vocab_size
        assert tok.detokenize(ids + [tok.eod]) == "the quick Grüße"


# ------------------------------------------------------------------------------------------ indexed dataset

def test_indexed_dataset_documents_views_and_stream(tmp_path):
    """Catches off-by-one document offsets, copies instead of memmap views, and get_tokens that stops
    at a document boundary."""
    docs = [[1, 2, 3], [], [4], [5, 6, 7, 8]]
    ds = IndexedDataset(write_dataset(tmp_path / "d", docs))
    assert len(ds) == 4 and ds.num_tokens == 8 and ds.dtype == np.uint16
    assert ds.sizes.tolist() == [3, 0, 1, 4] and ds.sizes.dtype == np.int64
    assert [ds[i].tolist() for i in range(4)] == docs and ds[-1].tolist() == [5, 6, 7, 8]
    assert not ds[0].flags.owndata and not ds.get_tokens(0, 5).flags.owndata  # views into the memmap
    assert ds.get_tokens(2, 4).tolist() == [3, 4, 5, 6]
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(ValueError, match="outside"):
        ds.get_tokens(6, 3)


def test_indexed_dataset_dtype_and_id_range(tmp_path):
    """Catches ids >= 65536 silently wrapping in uint16, and the wrong dtype for a large vocabulary."""
    big = IndexedDataset(write_dataset(tmp_path / "big", [[0, 70000, 99999]], vocab_size=100000))
    assert big.dtype == np.int32 and big[0].tolist() == [0, 70000, 99999]
    with pytest.raises(ValueError, match="out of range"):
        write_dataset(tmp_path / "bad", [[1, 70000]], vocab_size=1000)
    # The failed build left neither a dataset nor temporary files behind.
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]


def test_indexed_dataset_errors_name_the_file(tmp_path):
    """Catches unreadable data accepted silently: a missing file, a foreign or corrupted .idx, or a
    truncated .bin (e.g. an interrupted copy) must raise ValueError naming the file."""
    prefix = write_dataset(tmp_path / "d", [[1, 2, 3], [4, 5]])
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    good_idx, good_bin = open(idx, "rb").read(), open(bin_, "rb").read()

    with pytest.raises(ValueError, match="missing.idx: no such file"):
        IndexedDataset(str(tmp_path / "missing"))
    os.remove(bin_)
    with pytest.raises(ValueError, match=r"d\.bin: no such file"):
        IndexedDataset(prefix)
    open(bin_, "wb").write(good_bin[:-2])
    with pytest.raises(ValueError, match=r"d\.bin: truncated"):
        IndexedDataset(prefix)
    open(bin_, "wb").write(good_bin)
    open(idx, "wb").write(b"NOTANIDX\x00" + good_idx[9:])
    with pytest.raises(ValueError, match=r"d\.idx: bad magic.*not a Megatron-LM MMIDIDX index"):
        IndexedDataset(prefix)
    for cut in (len(good_idx) - 8, 10, 0):
        open(idx, "wb").write(good_idx[:cut])
        with pytest.raises(ValueError, match=r"d\.idx: truncated"):
            IndexedDataset(prefix)
    open(idx, "wb").write(good_idx)
    assert IndexedDataset(prefix)[1].tolist() == [4, 5]


def test_builder_is_atomic(tmp_path):
    """Catches a builder that writes in place: an aborted rebuild must leave the old dataset intact."""
    prefix = write_dataset(tmp_path / "d", [[1, 2]])
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, 1000) as builder:
            builder.add_document([7, 7, 7])
            raise RuntimeError("interrupted")
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


# --------------------------------------------------------------------------------------------- preprocessing

TEXT = "First paragraph, line one.\nLine two: naïve café.\n\n\n   \nGrüße aus 東京 🚀\n\nlast without newline"
PARAGRAPHS = ["First paragraph, line one.\nLine two: naïve café.", "Grüße aus 東京 🚀", "last without newline"]
JSON_DOCS = ["json doc one ü", "", "json doc\n\ntwo"]


# Slow documents first, then many fast ones: with 2 workers, later chunks finish first, so results
# written in completion order instead of input order would be caught.
MANY_DOCS = [f"heavy {i} " * 3000 for i in range(64)] + [f"light {i}" for i in range(200)]


def write_inputs(tmp_path):
    txt, jsonl, many = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "many.json"
    txt.write_text(TEXT, encoding="utf-8")
    for path, docs in ((jsonl, JSON_DOCS), (many, MANY_DOCS)):
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)),
                        encoding="utf-8")
    return str(txt), str(jsonl), str(many)


def test_preprocess_cli_round_trip(tmp_path):
    """Catches lost or merged documents (paragraph rule, jsonl, input order), non-ASCII damage, a missing
    eod, out-of-order worker results, and a CLI that only runs when the package is installed (it runs
    here with site-packages' .pth files off, so an editable install is invisible)."""
    txt, jsonl, many = write_inputs(tmp_path)
    prefix = str(tmp_path / "out" / "corpus")
    site_dirs = [p for p in sys.path if p and os.path.isdir(p) and os.path.abspath(p) != REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(site_dirs))
    result = subprocess.run(
        [sys.executable, "-S", PREPROCESS, "--input", txt, jsonl, many, "--output-prefix", prefix, "--workers", "2"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "269 documents" in result.stdout and "corpus.bin" in result.stdout
    tok = build_tokenizer("ByteLevelTokenizer")
    ds = IndexedDataset(prefix)
    expected = PARAGRAPHS + [t for t in JSON_DOCS if t] + MANY_DOCS
    assert len(ds) == len(expected)
    for i, text in enumerate(expected):
        assert ds[i].tolist() == list(text.encode("utf-8")) + [EOD]
        assert tok.detokenize(ds[i]) == text

    # Inline tokenization (--workers 1) writes the same bytes; --no-append-eod drops only the eod.
    preprocess = load_preprocess_module()
    preprocess.main(["--input", txt, jsonl, many, "--output-prefix", str(tmp_path / "inline")])
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "inline") + ext, "rb").read()
    preprocess.main(["--input", txt, "--output-prefix", str(tmp_path / "noeod"), "--no-append-eod"])
    noeod = IndexedDataset(str(tmp_path / "noeod"))
    assert [tok.detokenize(noeod[i]) for i in range(len(noeod))] == PARAGRAPHS
    assert EOD not in np.concatenate([noeod[i] for i in range(len(noeod))])


def test_preprocess_cli_errors(tmp_path, capsys):
    """Catches a traceback (or an empty dataset) instead of a usage error for bad input."""
    preprocess = load_preprocess_module()
    with pytest.raises(SystemExit):
        preprocess.main(["--input", str(tmp_path / "nope.txt"), "--output-prefix", str(tmp_path / "o")])
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        preprocess.main(["--input", str(bad), "--output-prefix", str(tmp_path / "o")])
    assert not any(f.startswith("o.") for f in os.listdir(tmp_path))


# ----------------------------------------------------------------------------------------- built-in corpus

def test_builtin_corpus_is_english_and_big_enough(corpus):
    """Catches a corpus that silently shrinks (imports failing, filters too strict) or is not prose."""
    text = "\n".join(corpus)
    assert len(text.encode("utf-8")) >= 500_000 and len(corpus) >= 1000
    words = text.lower().split()
    for word in ("the", "return", "file", "object", "string"):
        assert words.count(word) >= 200, word
    assert len(set(corpus)) == len(corpus)  # deduplicated
    assert all(len(doc.split()) >= 4 for doc in corpus)


def test_builtin_corpus_is_deterministic(corpus):
    """Catches order that depends on the process (set/dict iteration under hash randomization, import
    state): a second call and a fresh interpreter with another PYTHONHASHSEED give the same text."""
    digest = hashlib.sha256("\x00".join(corpus).encode("utf-8")).hexdigest()
    assert builtin_corpus_documents() == corpus
    code = ("import hashlib; from megatron_lite.data.corpus import builtin_corpus_documents as b; "
            "print(hashlib.sha256('\\x00'.join(b()).encode('utf-8')).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == digest


def test_builtin_corpus_ignores_what_libraries_patch_into_the_standard_library(corpus, monkeypatch):
    """Catches a corpus that depends on what the process imported: importing transformers adds methods to
    logging.Logger, and the built-in dataset then differed from a fresh interpreter's."""
    import logging
    import types

    library = types.ModuleType("some_library")
    library.__file__ = os.path.join(os.sep, "venv", "lib", "site-packages", "some_library", "__init__.py")
    monkeypatch.setitem(sys.modules, "some_library", library)

    def warning_once(self, message):
        """A method that a third-party library patches into the standard library's Logger class."""

    warning_once.__module__ = "some_library"
    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    assert builtin_corpus_documents() == corpus


def test_ensure_builtin_dataset_builds_once_and_repairs(tmp_path, corpus):
    """Catches rebuilding on every call, returning a broken cached dataset, and a tokenization that
    differs from the corpus (missing eod between documents)."""
    tok = build_tokenizer("ByteLevelTokenizer")
    prefix = ensure_builtin_dataset(str(tmp_path / "cache"), tok)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(corpus)
    assert ds[0].tolist() == tok.tokenize(corpus[0]) + [EOD]
    assert tok.detokenize(ds[len(ds) - 1]) == corpus[-1]
    mtime = os.stat(prefix + ".idx").st_mtime_ns
    assert ensure_builtin_dataset(str(tmp_path / "cache"), tok) == prefix
    assert os.stat(prefix + ".idx").st_mtime_ns == mtime  # reused, not rebuilt
    with open(prefix + ".bin", "r+b") as f:  # an interrupted copy
        f.truncate(1000)
    assert ensure_builtin_dataset(str(tmp_path / "cache"), tok) == prefix
    assert IndexedDataset(prefix).num_tokens == ds.num_tokens
    # write_builtin_dataset writes the same bytes under any prefix.
    other = write_builtin_dataset(str(tmp_path / "other"), tok)
    assert open(other + ".bin", "rb").read() == open(prefix + ".bin", "rb").read()


# ---------------------------------------------------------------------------------------------- GPTDataset

def stream_dataset(tmp_path, doc_sizes=(7, 1, 12, 5, 9, 3)):
    """Documents whose tokens are 0, 1, 2, ... across the whole stream: every value is unique."""
    offsets = np.cumsum((0,) + tuple(doc_sizes))
    docs = [list(range(offsets[i], offsets[i + 1])) for i in range(len(doc_sizes))]
    return IndexedDataset(write_dataset(tmp_path / "s", docs))


def gpt_dataset(indexed, documents, seq_length, seed, num_samples=None, split="train", **config):
    blend = ([indexed.prefix], None)
    return GPTDataset(indexed, documents, num_samples, split,
                      GPTDatasetConfig(seed, seq_length, blend=blend, split="1", **config))


def test_gpt_dataset_samples_are_windows_of_the_shuffled_stream(tmp_path):
    """Catches windows of the wrong length or stride, labels not shifted by one, a dropped or repeated
    sample within an epoch, and a document range that reads tokens of other documents."""
    indexed = stream_dataset(tmp_path)  # 37 tokens in 6 documents
    seq = 4
    ds = gpt_dataset(indexed, range(0, 6), seq_length=seq, seed=1)
    assert len(ds) == (37 - 1) // seq == 9
    stream = np.concatenate([indexed[int(d)] for d in ds.document_index])
    assert sorted(stream.tolist()) == list(range(37))  # every document once, in a shuffled order
    position = np.argsort(ds.shuffle_index)  # where sample k of the stream sits in the dataset
    for k in range(len(ds)):
        sample = ds[int(position[k])]
        tokens, labels = sample["tokens"], sample["labels"]
        assert tokens.dtype == labels.dtype == torch.int64 and tokens.shape == labels.shape == (seq,)
        assert tokens.tolist() == stream[k * seq:(k + 1) * seq].tolist()
        assert labels.tolist() == stream[k * seq + 1:(k + 1) * seq + 1].tolist()
    assert ds.shuffle_index.tolist() != list(range(9))  # shuffled

    # Documents 2..4 are tokens 8..33: samples never read another document's tokens.
    sub = gpt_dataset(indexed, range(2, 5), seq_length=seq, seed=1)
    assert len(sub) == (26 - 1) // seq
    assert all(8 <= int(sub[i]["tokens"].min()) and int(sub[i]["labels"].max()) < 34 for i in range(len(sub)))


def test_gpt_dataset_epochs_and_seeds(tmp_path):
    """Catches an order that is not a pure function of the seed, and a multi-epoch dataset that does not
    show every document once per epoch."""
    indexed = stream_dataset(tmp_path, doc_sizes=(50, 51, 60))
    order = lambda ds: [int(ds[i]["tokens"][0]) for i in range(len(ds))]  # noqa: E731
    a, b = gpt_dataset(indexed, range(3), 4, seed=7, num_samples=150), gpt_dataset(indexed, range(3), 4, 7, 150)
    c = gpt_dataset(indexed, range(3), 4, seed=8, num_samples=150)
    assert order(a) == order(b) and order(a) != order(c)
    assert a.num_epochs == 4 and len(a) >= 150  # 150 x 4 + 1 tokens need 4 epochs of 161
    assert np.bincount(a.document_index).tolist() == [4, 4, 4]


def test_gpt_dataset_too_small(tmp_path):
    """Catches an empty split turning into a zero-length dataset (a division by zero or an endless
    loop later, as in megatron-core) instead of a clear error."""
    indexed = stream_dataset(tmp_path, doc_sizes=(4, 4))
    assert len(gpt_dataset(indexed, range(2), seq_length=7, seed=0)) == 1  # 8 tokens = one window of 8
    with pytest.raises(ValueError, match="split too small for --seq-length 8"):
        gpt_dataset(indexed, range(2), seq_length=8, seed=0)
    with pytest.raises(ValueError, match="split too small"):
        gpt_dataset(indexed, range(1, 1), seq_length=2, seed=0, num_samples=10)


@pytest.mark.parametrize("num_docs,split,expected", [
    (1000, "969,30,1", (969, 30, 1)),
    (1000, "98,2,0", (980, 20, 0)),
    (100, "98,2", (98, 2, 0)),
    (100, "100", (100, 0, 0)),
    (10, "1,1,1", (3, 4, 3)),  # megatron-core: round(10/3) = 3, round(20/3) = 7 (legacy Megatron: 4, 3, 3)
    (10, "1/1/1", (3, 4, 3)),
    (1, "969,30,1", (1, 0, 0)),
    (10, "1,99,0", (0, 10, 0)),  # train rounds to no document (pretrain_gpt.py then stops with an error)
    (3, "0.5,0.5", (2, 1, 0)),  # round(1.5) = 2: halves to even, Python's round
])
def test_split_documents(num_docs, split, expected):
    """Catches wrong normalization or rounding and non-contiguous ranges."""
    ranges = split_documents(num_docs, split)
    assert tuple(len(r) for r in ranges) == expected
    assert all(r.step == 1 for r in ranges)
    assert ranges[0].start == 0 and ranges[0].stop == ranges[1].start and ranges[1].stop == ranges[2].start
    assert ranges[2].stop == num_docs


def test_split_documents_always_covers_all_documents():
    """Catches boundaries that overshoot or leave a gap for some document counts."""
    for split in ("969,30,1", "1,1,1", "3,3,1", "1,1000,1000", "7"):
        for n in range(1, 60):
            train, valid, test = split_documents(n, split)
            assert list(train) + list(valid) + list(test) == list(range(n))


@pytest.mark.parametrize("split", ["", "abc", "1,2,3,4", "-1,2,0", "0,1,0", "1,,2", "nan,1", "0,0,0"])
def test_split_documents_errors(split):
    """Catches malformed --split strings accepted silently (e.g. a negative weight flipping a range)."""
    with pytest.raises(ValueError, match="--split"):
        split_documents(100, split)


def test_split_documents_needs_documents():
    """Catches splitting an empty corpus into empty ranges that fail much later."""
    with pytest.raises(ValueError, match="at least one document"):
        split_documents(0, "1,0,0")


# -------------------------------------------------------------------------------------------- sampling

def global_batches(dataset, global_batch_size, micro_batch_size, dp, iterations, consumed=0):
    """What the trainer does: per iteration gbs / (mbs x dp) micro-steps, each advancing consumed by
    mbs x dp. Returns per iteration the sorted samples of all ranks (token tuples), and per rank lists."""
    batches = []
    for _ in range(iterations):
        samples = []
        for _ in range(global_batch_size // (micro_batch_size * dp)):
            per_rank = [get_batch_for_rank(dataset, consumed, micro_batch_size, r, dp) for r in range(dp)]
            for batch in per_rank:
                assert batch["tokens"].shape == batch["labels"].shape == (micro_batch_size, dataset.seq_length)
                assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
                samples += [tuple(t.tolist()) for t in batch["tokens"]]
            consumed += micro_batch_size * dp
        batches.append(sorted(samples))
    return batches, consumed


def test_global_batch_is_independent_of_dp_size(tmp_path):
    """Catches a sampler whose global batch depends on the DP size (e.g. consumed_samples read as a
    per-rank count), which breaks equivalence across DP sizes and resuming from a checkpoint."""
    indexed = stream_dataset(tmp_path, doc_sizes=(300, 200, 250))
    ds = gpt_dataset(indexed, range(3), seq_length=8, seed=3, num_samples=128)  # 3 iterations cross an epoch
    reference, consumed = global_batches(ds, 32, 2, 1, iterations=4)
    assert consumed == 128 and reference[0] != reference[1]
    assert len(set(reference[0] + reference[1])) == 64  # the first epoch: no sample twice
    for dp in (2, 4):
        assert global_batches(ds, 32, 2, dp, iterations=4)[0] == reference
    # Resuming at consumed_samples=64 gives the same third and fourth batches.
    assert global_batches(ds, 32, 4, 2, iterations=2, consumed=64)[0] == reference[2:]
    with pytest.raises(ValueError, match="data_parallel_rank"):
        get_batch_for_rank(ds, 0, 2, 2, 2)


def test_get_batch_for_rank_takes_contiguous_indices():
    """Catches a different assignment of indices to ranks than Megatron's sampler
    (rank r: [consumed + r*mbs, consumed + (r+1)*mbs))."""
    class Indices:
        seq_length = 1

        def __getitem__(self, i):
            return {"tokens": torch.tensor([i]), "labels": torch.tensor([i + 1])}

    batch = get_batch_for_rank(Indices(), consumed_samples=40, micro_batch_size=3, data_parallel_rank=2,
                               data_parallel_size=4)
    assert batch["tokens"][:, 0].tolist() == [46, 47, 48]


def test_mock_dataset_is_learnable_and_deterministic():
    """Catches mock data that is pure noise (cannot show learning), that emits eod or out-of-vocab ids,
    that changes between calls, or whose train and valid sets coincide."""
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    train, valid = MockGPTDataset(tok.vocab_size, 128, seed=5), MockGPTDataset(tok.vocab_size, 128, seed=6)
    assert isinstance(train, MockGPTDataset) and len(train) >= 2**31
    for i in (0, 1, 10**9):
        tokens, labels = train[i]["tokens"], train[i]["labels"]
        assert torch.equal(tokens, train[i]["tokens"])
        assert tokens.shape == (128,) and torch.equal(tokens[1:], labels[:-1])
        assert int(tokens.max()) < tok.eod and int(tokens.min()) >= 0
        steps = (torch.cat([tokens, labels[-1:]]).diff() % (tok.vocab_size - 1)).unique()
        assert len(steps) == 1 and 1 <= int(steps) <= MockGPTDataset.MAX_STEP  # one progression
    steps = {int((train[i]["tokens"][1] - train[i]["tokens"][0]) % (tok.vocab_size - 1)) for i in range(40)}
    assert steps == set(range(1, MockGPTDataset.MAX_STEP + 1))  # d varies: inferring it needs context
    assert not torch.equal(train[0]["tokens"], train[1]["tokens"])
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])


def test_build_datasets_from_prefix(tmp_path):
    """Catches train and valid built from overlapping documents, or an empty valid split crashing."""
    indexed = stream_dataset(tmp_path, doc_sizes=(20,) * 10)
    config = lambda split: GPTDatasetConfig(0, 4, blend=([indexed.prefix], None), split=split)  # noqa: E731
    train, valid, test = build_datasets(config("8,2,0"), [None, None, None])
    assert (train.documents, valid.documents, test) == (range(0, 8), range(8, 10), None)
    assert max(int(train[i]["labels"].max()) for i in range(len(train))) < 160
    assert min(int(valid[i]["tokens"].min()) for i in range(len(valid))) >= 160
    train, valid, _ = build_datasets(config("100,0,0"), [None, None, None])
    assert valid is None and len(train) == (200 - 1) // 4
