"""Megatron-LM's MMIDIDX .bin/.idx format (`megatron_lite/data/indexed_dataset.py`): every dtype code, the
document index, a fixture written byte by byte from the spec that pretrain_gpt.py trains on, and the errors for
files it cannot read (megatron-lite's old format among them).

The fixture is built here with struct.pack from the layout in megatron-core's `indexed_dataset.py`, not with
the library's writer, so a reader and writer that agree with each other but not with Megatron-LM are caught.
"""

import math
import os
import struct

import numpy as np
import pytest
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags

from megatron_lite.data import IndexedDataset, IndexedDatasetBuilder, build_tokenizer, ensure_builtin_dataset
from megatron_lite.data.corpus import builtin_dataset_name

# megatron-core's DType enum, restated from its source: code -> numpy dtype of the token ids.
MEGATRON_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                        7: np.float32, 8: np.uint16}


def write_mmididx_by_hand(prefix, sequences, document_indices, code, sequence_modes=None):
    """PREFIX.bin/.idx exactly as megatron-core's _IndexWriter lays them out, field by field."""
    dtype = np.dtype(MEGATRON_DTYPE_CODES[code]).newbyteorder("<")
    lengths = [len(s) for s in sequences]
    pointers = [sum(lengths[:i]) * dtype.itemsize for i in range(len(lengths))]
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")                       # 9-byte magic
        f.write(struct.pack("<Q", 1))                     # version
        f.write(struct.pack("<B", code))                  # dtype code
        f.write(struct.pack("<Q", len(sequences)))        # sequence count
        f.write(struct.pack("<Q", len(document_indices)))  # document count (entries of document_indices)
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(document_indices)}q", *document_indices))
        if sequence_modes is not None:
            f.write(struct.pack(f"<{len(sequence_modes)}b", *sequence_modes))
    return prefix


@pytest.mark.parametrize("code", sorted(MEGATRON_DTYPE_CODES))
def test_round_trip_every_dtype_code_with_document_index(tmp_path, code):
    """Would catch a dtype code mapped to the wrong numpy type (ids read at the wrong width), sequence pointers
    in tokens instead of bytes, a document index without its leading 0 or with per-document instead of
    per-sequence entries, and a writer whose bytes differ from the spec."""
    dtype = MEGATRON_DTYPE_CODES[code]
    top = 127 if dtype == np.int8 else 255 if dtype == np.uint8 else 30000
    vocab_size = top + 1
    # Document 0 is two sequences (as with sentence splitting), document 1 is empty, document 2 is one.
    documents = [([1, 2, top, 4, 5], [2, 3]), ([], None), ([7, 0, top - 1], None)]
    prefix = str(tmp_path / f"code{code}")
    with IndexedDatasetBuilder(prefix, vocab_size, dtype=dtype) as builder:
        for ids, lengths in documents:
            builder.add_document(np.asarray(ids, dtype=np.int64), lengths)
    sequences = [[1, 2], [top, 4, 5], [], [7, 0, top - 1]]
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and len(ds) == 4 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(4)] == sequences
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert ds.sequence_lengths.tolist() == [2, 3, 0, 3]
    assert ds.sequence_pointers.tolist() == [0, 2 * ds.dtype.itemsize, 5 * ds.dtype.itemsize, 5 * ds.dtype.itemsize]
    assert ds.get_tokens(1, 3).tolist() == [2, top, 4]
    by_hand = write_mmididx_by_hand(str(tmp_path / "by_hand"), sequences, [0, 2, 3, 4], code)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(by_hand + ext, "rb").read(), ext


def test_builder_refuses_a_dtype_too_small_for_the_vocabulary(tmp_path):
    """Would catch ids silently wrapped or rounded: uint8 for a 1000-token vocabulary, float32 (exact only up
    to 2**24) for a larger one, or a dtype Megatron-LM has no code for."""
    with pytest.raises(ValueError, match="cannot hold token ids up to 999"):
        IndexedDatasetBuilder(str(tmp_path / "a"), 1000, dtype=np.uint8)
    with pytest.raises(ValueError, match="float32 cannot hold"):
        IndexedDatasetBuilder(str(tmp_path / "b"), 2**24 + 2, dtype=np.float32)
    with pytest.raises(ValueError, match="uint32 has no MMIDIDX code"):
        IndexedDatasetBuilder(str(tmp_path / "c"), 1000, dtype=np.uint32)
    with IndexedDatasetBuilder(str(tmp_path / "d"), 1000) as builder:
        with pytest.raises(ValueError, match="sum to the document's 3 tokens"):
            builder.add_document([1, 2, 3], [1, 1])
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # the refused builders left nothing behind


def fixture_documents(num_docs=60, seed=0):
    """Byte-level 'documents' (ids < 256) each ending in the ByteLevelTokenizer's eod (256)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(20, 60))).tolist() + [256] for _ in range(num_docs)]


def test_spec_fixture_is_read_and_trains(tmp_path):
    """A dataset laid out as Megatron-LM's preprocessing writes it (uint16, one sequence per document, written
    here byte by byte) is read token for token and trained on by `pretrain_gpt.py --data-path PREFIX`.
    Would catch a reader that only reads its own writer's files, e.g. a header of the wrong size (every
    token shifted: ids out of range or garbage), and a training path that still expects another format."""
    documents = fixture_documents()
    prefix = write_mmididx_by_hand(str(tmp_path / "megatron_gpt_text_document"), documents,
                                   list(range(len(documents) + 1)), code=8)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(documents)
    assert [ds[i].tolist() for i in range(len(ds))] == documents
    assert ds.get_tokens(0, ds.num_tokens).tolist() == [t for doc in documents for t in doc]

    argv = tiny_pretrain_flags(mock_data=None, train_iters="2", log_interval="1", data_path=prefix,
                               split="100,0,0")
    losses = run_distributed(pretrain_losses, 1, argv)[0]
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    # Random bytes: the first loss is near a uniform guess over the padded vocabulary (ln 384 = 5.95).
    assert abs(losses[1] - math.log(384)) < 0.5, losses


def test_multimodal_sequence_modes_are_tolerated(tmp_path):
    """Would catch an index with megatron-core's trailing int8 sequence modes rejected as corrupt."""
    prefix = write_mmididx_by_hand(str(tmp_path / "mm"), [[1, 2], [3]], [0, 1, 2], code=4, sequence_modes=[0, 1])
    assert [IndexedDataset(prefix)[i].tolist() for i in range(2)] == [[1, 2], [3]]


def write_old_megatron_lite_format(prefix, documents):
    """megatron-lite's format before MMIDIDX: 'MLITEIDX', version, dtype code (1 = uint16), 7 pad, n_docs,
    then n_docs + 1 int64 token offsets."""
    offsets = np.cumsum([0] + [len(d) for d in documents]).astype("<i8")
    with open(prefix + ".bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype="<u2").tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<8sQB7xQ", b"MLITEIDX", 1, 1, len(documents)))
        f.write(offsets.tobytes())
    return prefix


def test_old_megatron_lite_format_gets_a_clear_error(tmp_path):
    """Would catch an old-format file read as MMIDIDX (garbage tokens) or refused with a bare 'bad magic':
    the message names the file, the old format, and the command that regenerates it. The built-in corpus
    cache, where old files exist on every machine that ran an older version, is rebuilt instead."""
    prefix = write_old_megatron_lite_format(str(tmp_path / "old"), [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"old\.idx: written in megatron-lite's old format.*MMIDIDX.*"
                                         r"python tools/preprocess_data\.py --input YOUR_TEXT --output-prefix .*old"):
        IndexedDataset(prefix)
    tok = build_tokenizer("ByteLevelTokenizer")
    cache = tmp_path / "cache"
    cache.mkdir()
    write_old_megatron_lite_format(str(cache / builtin_dataset_name(tok)), [[1, 2, 3]])
    rebuilt = IndexedDataset(ensure_builtin_dataset(str(cache), tok))
    assert len(rebuilt) > 1000 and rebuilt[0][-1] == tok.eod


def test_corrupt_index_is_refused_naming_the_file(tmp_path):
    """Would catch indexes accepted that would read the wrong tokens: an unknown dtype code, a document index
    that does not end at the sequence count, pointers with gaps (not one token stream), a newer version."""
    sequences, doc_index = [[1, 2], [3, 4, 5]], [0, 1, 2]
    prefix = write_mmididx_by_hand(str(tmp_path / "d"), sequences, doc_index, code=8)
    good = open(prefix + ".idx", "rb").read()
    header, n = 34, len(sequences)
    pointers_at = header + 4 * n
    cases = [
        (good[:9] + struct.pack("<Q", 2) + good[17:], "unsupported MMIDIDX version 2"),
        (good[:17] + bytes([9]) + good[18:], "unknown dtype code 9"),
        (good[:-8] + struct.pack("<q", 1), "corrupt document indices"),
        (good[:pointers_at + 8] + struct.pack("<q", 6) + good[pointers_at + 16:], "pointers leave gaps"),
        (good + b"\x00" * 3, "truncated or corrupt"),
    ]
    for idx_bytes, message in cases:
        open(prefix + ".idx", "wb").write(idx_bytes)
        with pytest.raises(ValueError, match=r"d\.idx: .*" + message):
            IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(good)
    assert IndexedDataset(prefix)[1].tolist() == [3, 4, 5]
