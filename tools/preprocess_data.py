"""Tokenize text into an indexed dataset (PREFIX.bin/.idx) for pretrain_gpt.py's --data-path PREFIX.

The files are in Megatron-LM's MMIDIDX format (megatron_lite/data/indexed_dataset.py), one sequence per
document: megatron-core's IndexedDataset reads them, and Megatron-LM's own preprocessing output trains here.

    python tools/preprocess_data.py --input notes.txt more.jsonl --output-prefix data/my_corpus
    python tools/preprocess_data.py --input builtin --output-prefix data/stdlib_docs --workers 2
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/web --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt     # as Megatron-LM's, byte for byte

What a document is:
  * `*.jsonl` / `*.json`: one JSON object per line; the document is the object's `--json-key` field
    (default 'text'). Blank lines are skipped.
  * any other file: UTF-8 plain text split into paragraphs. A document is a run of non-blank lines;
    one or more blank (empty or whitespace-only) lines separate documents. Line breaks inside a
    paragraph are kept ('\\r\\n' is read as '\\n'); the newline ending its last line is not.
  * `builtin`: the standard library's docstrings (megatron_lite.data.corpus), nothing to download.
Files are UTF-8 (a byte order mark at a file's start is skipped). Empty documents are skipped; an input
that holds no document at all (an empty file, only blank lines, only empty JSON fields) is an error naming
it, and nothing is written. With --append-eod (the default)
every document ends in the tokenizer's eod token, which is how GPTDataset tells documents apart. Output
order is input order for any --workers.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time

try:
    import megatron_lite  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from megatron_lite.data.corpus import builtin_corpus_documents
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, dtype_for_vocab_size
from megatron_lite.data.tokenizer import TOKENIZER_TYPES, add_tokenizer_file_arguments, build_tokenizer

BUILTIN = "builtin"
TEXT_TOKENIZER_TYPES = tuple(name for name in TOKENIZER_TYPES if name != "NullTokenizer")
_ENCODING = "utf-8-sig"
"""UTF-8, a byte order mark at the start of a file skipped (Windows editors write one); it is not text."""


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help=f"text or .jsonl files, or '{BUILTIN}' for the standard-library docstring corpus")
    group.add_argument("--json-key", default="text", help="field of each JSON line that holds the document")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TEXT_TOKENIZER_TYPES,
                       help="Megatron's names (megatron_lite/data/tokenizer.py): ByteLevelTokenizer and "
                            "GPT2BPETokenizer need nothing, the SentencePiece types `sentencepiece`, "
                            "HuggingFaceTokenizer `tokenizers`")
    add_tokenizer_file_arguments(group)
    group.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                       help="end every document with the eod token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenizer processes; 1 tokenizes inline, the fastest for ByteLevelTokenizer")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    for path in args.input:
        if path != BUILTIN and not os.path.isfile(path):
            parser.error(f"--input {path!r}: no such file")
    for path in args.input:
        # Before any output exists: a wrong file or --json-key would otherwise give a 0-document dataset
        # that fails only later, in training. Reads up to the file's first document.
        if path != BUILTIN and not has_documents(path, args.json_key):
            what = f"only blank lines or empty {args.json_key!r} fields" if _is_json(path) else "only blank lines"
            parser.error(f"--input {path!r}: no documents (the file is empty or holds {what})")
    try:  # also refuses a file flag the tokenizer type would ignore (tokenizing byte by byte)
        args.tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_file=args.vocab_file,
                                         merge_file=args.merge_file)
    except ValueError as e:
        parser.error(str(e))
    return args


def _paragraphs(path):
    lines = []
    with open(path, encoding=_ENCODING) as f:
        try:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines)[:-1]  # drop the newline ending the paragraph's last line
                    lines = []
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if lines:
        text = "".join(lines)
        yield text[:-1] if text.endswith("\n") else text


def _json_lines(path, key):
    with open(path, encoding=_ENCODING) as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                yield _json_text(path, lineno, line, key)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text after line {lineno} ({e})") from None


def _json_text(path, lineno, line, key):
    try:
        text = json.loads(line)[key]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}:{lineno}: expected a JSON object with a string {key!r} field ({e!r})") from None
    if not isinstance(text, str):
        raise ValueError(f"{path}:{lineno}: field {key!r} is {type(text).__name__}, not a string")
    # A lone surrogate escape ("\ud800") decodes to a str that no tokenizer can encode: name the line here,
    # not in a worker's traceback. Decoded UTF-8 holds no surrogates, so only escapes need the check.
    if "\\ud" in line or "\\uD" in line:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path}:{lineno}: field {key!r} holds an unpaired surrogate escape "
                             f"({e.reason}); fix or drop that line") from None
    return text


def _is_json(path):
    return path.endswith((".jsonl", ".json"))


def _documents(path, json_key):
    """Yields the texts of one input's non-empty documents, in order."""
    if path == BUILTIN:
        documents = builtin_corpus_documents()
    elif _is_json(path):
        documents = _json_lines(path, json_key)
    else:
        documents = _paragraphs(path)
    for text in documents:
        if text:
            yield text


def has_documents(path, json_key):
    """Whether the input holds at least one non-empty document (reads up to the first)."""
    with contextlib.closing(_documents(path, json_key)) as documents:
        return next(documents, None) is not None


def read_documents(paths, json_key):
    """Yields every document's text, in input order (empty ones skipped)."""
    for path in paths:
        yield from _documents(path, json_key)


# Per-process tokenizer state: set in the main process for --workers 1, by the initializer otherwise.
_state = {}


def _init_worker(tokenizer_type, tokenizer_model, vocab_file, merge_file, append_eod):
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file=vocab_file, merge_file=merge_file)
    _state.update(tokenizer=tokenizer, append_eod=append_eod, dtype=dtype_for_vocab_size(tokenizer.vocab_size))


def _encode(text):
    tokenizer = _state["tokenizer"]
    ids = tokenizer.tokenize(text)
    if _state["append_eod"]:
        ids = list(ids) + [tokenizer.eod]
    # A compact array pickles far faster than a list of ints on the way back from a worker.
    return np.asarray(ids, dtype=_state["dtype"]), len(text.encode("utf-8"))


class Progress:
    """tqdm when installed, else a line on stderr at most once a second."""

    def __init__(self):
        try:
            from tqdm import tqdm
            self._bar = tqdm(unit=" docs", file=sys.stderr, mininterval=0.5)
        except ImportError:
            self._bar = None
        self.start = self._last = time.perf_counter()
        self.docs = self.tokens = self.nbytes = 0

    def update(self, num_tokens, num_bytes):
        self.docs += 1
        self.tokens += num_tokens
        self.nbytes += num_bytes
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.perf_counter()
        if now - self._last >= 1.0:
            self._last = now
            print(f"  {self.docs} docs, {self.tokens} tokens | {self.rates()}", file=sys.stderr, flush=True)

    def rates(self):
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return f"{self.docs / elapsed:.0f} docs/s, {self.nbytes / elapsed / 1e6:.2f} MB/s"

    def close(self):
        if self._bar is not None:
            self._bar.close()


def main(argv=None):
    args = get_args(argv)
    tokenizer = args.tokenizer
    init_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.append_eod)
    progress = Progress()
    texts = read_documents(args.input, args.json_key)
    pool = None
    if args.workers == 1:
        _init_worker(*init_args)
        encoded = map(_encode, texts)
    else:
        pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init_args)
        encoded = pool.imap(_encode, texts, chunksize=32)  # imap, not imap_unordered: keep input order
    try:
        with IndexedDatasetBuilder(args.output_prefix, tokenizer.vocab_size) as builder:
            for ids, num_bytes in encoded:
                builder.add_document(ids)
                progress.update(len(ids), num_bytes)
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    print(f"> {progress.docs} documents, {progress.tokens} tokens ({tokenizer.__class__.__name__}, "
          f"vocab_size {tokenizer.vocab_size}, eod {tokenizer.eod}) from {progress.nbytes / 1e6:.2f} MB of text "
          f"in {time.perf_counter() - progress.start:.2f} s: {progress.rates()}")
    for ext in (".bin", ".idx"):
        path = args.output_prefix + ext
        print(f"> wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
