"""Tokenizers behind one small interface: `vocab_size`, `eod`, `tokenize(text)`, `detokenize(ids)`, built by
Megatron's `--tokenizer-type` name from the files its flags name.

    --tokenizer-type            reads                          eod                       needs
    ByteLevelTokenizer          -                              256 (vocab_size 257)      -
    GPT2BPETokenizer            --vocab-file --merge-file      '<|endoftext|>'           -
    SentencePieceTokenizer,     --tokenizer-model              the model's eos piece     sentencepiece
    GPTSentencePieceTokenizer,  (a SentencePiece .model)
    Llama2Tokenizer
    HuggingFaceTokenizer        --tokenizer-model              the eos_token of          tokenizers
                                (tokenizer.json, or its dir)   tokenizer_config.json
    NullTokenizer               --vocab-size                   vocab_size - 1            -

The ids, eod and vocab_size are megatron-core 0.16.1's for the same flags (its MegatronTokenizer, which
Megatron-LM's preprocess_data.py and pretrain_gpt.py build unless given --legacy-tokenizer), so a corpus
preprocessed by either tool gives the same .bin/.idx (tests/data/test_megatron_tokenizers.py):
  * GPT2BPETokenizer: GPT-2's byte-level BPE in plain Python (gpt2_bpe.py); the text '<|endoftext|>' inside a
    document is the eod token, as megatron-core's transformers-backed GPT-2 tokenizer reads it.
  * The three SentencePiece types are one in megatron-core: the model's pieces (vocab_size = its piece count), no
    BOS or EOS added, eod = the model's eos id. (Megatron-LM's --legacy-tokenizer classes differ: its
    SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> to the vocabulary with eod = <EOD>, its
    Llama2Tokenizer starts every document with BOS. Not reproduced here.)
  * HuggingFaceTokenizer: no BOS/EOS added by a post-processor; eod = the tokenizer's eos_token (else its
    sep_token) as transformers reads it from special_tokens_map.json or tokenizer_config.json beside
    tokenizer.json. Without either (a bare tokenizer.json, where megatron-core has no eod at all) the token named
    '<|endoftext|>', else '</s>', else a new id vocab_size that the tokenizer never produces.

`detokenize` drops `eod`, so a document's ids (stored with `eod` appended) turn back into its text. The trainer,
not the tokenizer, pads the vocabulary for the embedding table (Megatron's `--make-vocab-size-divisible-by`).
"""

import json
import os
from typing import Iterable, List, Optional

from .gpt2_bpe import ENDOFTEXT, GPT2BPE, read_merges, read_vocab

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
FILE_FLAGS = {
    "ByteLevelTokenizer": (),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    **{name: ("tokenizer_model",) for name in SENTENCEPIECE_TYPES},
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
}
"""The file flags each --tokenizer-type reads (argparse dests), all required: another would be ignored."""
TOKENIZER_TYPES = tuple(FILE_FLAGS)

EOD_TOKENS = ("<|endoftext|>", "</s>")
"""Tokens that `HuggingFaceTokenizer` takes as end-of-document when the tokenizer names no eos_token, first match
wins (GPT-2 style, then T5/Llama)."""

EOS_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""The files beside a tokenizer.json that name its eos_token (transformers reads both; the later one wins)."""

_FLAG_HELP = {"vocab_file": "--vocab-file vocab.json", "merge_file": "--merge-file merges.txt",
              "tokenizer_model": "--tokenizer-model"}
_MODEL_HELP = {**{name: "a SentencePiece tokenizer.model" for name in SENTENCEPIECE_TYPES},
               "HuggingFaceTokenizer": "a tokenizer.json, or the directory holding it"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class ByteLevelTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, `eod` = 256, `vocab_size` = 257."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> List[int]:
        """Args: text. Returns: its UTF-8 bytes as ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Args: ids (eod is dropped). Returns: the decoded text; invalid UTF-8 (e.g. a sample cut
        through a multi-byte character) and ids above 256 (a padded vocabulary) become U+FFFD."""
        # 0xFF never occurs in UTF-8, so it decodes to U+FFFD like any other invalid byte.
        data = bytes(i if 0 <= i < 256 else 0xFF for i in map(int, ids) if i != self.eod)
        return data.decode("utf-8", errors="replace")


class GPT2BPETokenizer:
    """Megatron's GPT-2 tokenizer: byte-level BPE from GPT-2's vocab.json and merges.txt, eod '<|endoftext|>'.

    Args:
        vocab_file: vocab.json ({token: id}, ids 0..n-1; vocab_size = n).
        merge_file: merges.txt (a '#version' line, then one 'left right' merge per line).
    """

    def __init__(self, vocab_file: str, merge_file: str):
        self._bpe = GPT2BPE(read_vocab(vocab_file), read_merges(merge_file))
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.vocab_size = len(self._bpe.encoder)
        if ENDOFTEXT not in self._bpe.encoder:
            raise ValueError(f"--vocab-file {vocab_file!r} has no {ENDOFTEXT!r} token, GPT2BPETokenizer's "
                             f"end-of-document (Megatron's eod): add it to vocab.json, or use HuggingFaceTokenizer "
                             f"with a tokenizer.json that names its eos_token")
        self.eod = self._bpe.encoder[ENDOFTEXT]

    def tokenize(self, text: str) -> List[int]:
        """Args: text. Returns: its ids; each '<|endoftext|>' in the text is the eod id (megatron-core's rule)."""
        ids = []
        for n, piece in enumerate(text.split(ENDOFTEXT)):
            if n:
                ids.append(self.eod)
            ids.extend(self._bpe.encode(piece))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Args: ids (eod is dropped). Returns: the decoded text."""
        return self._bpe.decode(i for i in map(int, ids) if i != self.eod)


class SentencePieceTokenizer:
    """A SentencePiece model, as megatron-core reads it for SentencePieceTokenizer, GPTSentencePieceTokenizer and
    Llama2Tokenizer: its pieces as the vocabulary, no BOS/EOS added, eod = its eos id.

    Args:
        tokenizer_model: path to the SentencePiece .model file.
        tokenizer_type: the --tokenizer-type name (for messages).
    """

    def __init__(self, tokenizer_model: str, tokenizer_type: str = "SentencePieceTokenizer"):
        try:
            import sentencepiece
        except ImportError as e:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs the optional 'sentencepiece' package "
                             f"(pip install -e \".[megatron]\", or pip install sentencepiece)") from e
        self.tokenizer_model = tokenizer_model
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} is not a SentencePiece model ({e}); a "
                             f"tokenizer.json goes with --tokenizer-type HuggingFaceTokenizer") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if not 0 <= self.eod < self.vocab_size:
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} has no end-of-sentence piece (eos_id "
                             f"{self.eod}), which {tokenizer_type} takes as eod: train it with an eos piece "
                             f"(SentencePieceTrainer's eos_id, default 2)")

    def tokenize(self, text: str) -> List[int]:
        """Args: text. Returns: its ids (no BOS/EOS)."""
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Args: ids (eod is dropped). Returns: the decoded text."""
        return self._sp.decode_ids([i for i in map(int, ids) if i != self.eod])


class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` from a local tokenizer.json (no download, no `transformers`), eod = its eos_token.

    Args:
        tokenizer_model: path to a tokenizer.json file, or to the directory holding it (and, as transformers
            reads them, special_tokens_map.json / tokenizer_config.json naming the eos_token).
        by_name: take the eod by name only, as if no file named an eos_token: megatron-lite's rule before it
            followed megatron-core (98f4df2), which checkpoints that record no eod trained with.
    """

    def __init__(self, tokenizer_model: str, by_name: bool = False):
        path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {tokenizer_model!r}: no tokenizer.json in that directory (a model "
                             f"directory with only vocab.json/merges.txt goes with --tokenizer-type GPT2BPETokenizer "
                             f"--vocab-file --merge-file)")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ValueError(
                "HuggingFaceTokenizer needs the optional 'tokenizers' package (pip install -e \".[hf]\", the "
                "Hugging Face extra, or pip install tokenizers); "
                "ByteLevelTokenizer needs nothing"
            ) from e
        self.tokenizer_model = tokenizer_model
        self.tokenizer_json = path
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the Rust library's error (not JSON, not a tokenizer), without the file's name
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} is not a tokenizer.json that the 'tokenizers' "
                             f"package can read ({e}); a SentencePiece .model goes with --tokenizer-type "
                             f"{' / '.join(SENTENCEPIECE_TYPES)}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token = None if by_name else eos_token(os.path.dirname(path))
        if self.eos_token is not None:
            self.eod = self._tokenizer.token_to_id(self.eos_token)
            if self.eod is None:
                raise ValueError(f"--tokenizer-model {tokenizer_model!r}: the eos_token {self.eos_token!r} its "
                                 f"tokenizer_config.json / special_tokens_map.json name is not in tokenizer.json's "
                                 f"vocabulary: fix the eos_token there")
            return
        for token in EOD_TOKENS:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eod = token_id
                break
        else:
            # No end-of-document token: reserve the next id. The tokenizer never produces it, so it
            # cannot collide with text.
            self.eod = self.vocab_size
            self.vocab_size += 1

    def tokenize(self, text: str) -> List[int]:
        """Args: text. Returns: its ids, without special tokens (no BOS/EOS added by a post-processor)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Args: ids (eod is dropped). Returns: the decoded text."""
        return self._tokenizer.decode([int(i) for i in ids if int(i) != self.eod], skip_special_tokens=False)


def trained_eod(saved_args: dict, tokenizer_type: str, tokenizer_model: Optional[str]) -> Optional[int]:
    """The end-of-document id a checkpoint's run trained with: its recorded `eod`; for a HuggingFaceTokenizer run
    saved before the eod followed the eos_token (98f4df2; its args record no vocab_file) the eod by name of
    `tokenizer_model`'s tokenizer.json; else None (saved by 98f4df2's version: the rule in force now)."""
    if saved_args.get("eod") is not None:
        return saved_args["eod"]
    if "vocab_file" not in saved_args and tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, by_name=True).eod
    return None


def check_trained_eod(saved_args: dict, tokenizer_type: str, tokenizer_model: Optional[str], eod: int,
                      checkpoint: str, remedy: str = ""):
    """Raise ValueError when `eod` (this run's tokenizer's) is not the end-of-document id the checkpoint's run
    trained with: its recorded `eod`, or for a HuggingFaceTokenizer run saved before the eod followed the
    eos_token (its args record no vocab_file), the eod by name of the same tokenizer.json. Resuming would
    change what its data and --eod-mask-loss mean by eod; an export would name another eos_token_id.

    Args:
        saved_args: the checkpoint's recorded args.
        tokenizer_type, tokenizer_model, eod: this run's tokenizer.
        checkpoint: the checkpoint, as the message names it.
        remedy: another way out, appended to the message.
    """
    trained = trained_eod(saved_args, tokenizer_type, tokenizer_model)
    if "eod" not in saved_args and trained is not None:
        if trained != eod:
            raise ValueError(
                f"{checkpoint} was saved before megatron-lite took HuggingFaceTokenizer's eod from the eos_token of "
                f"{' / '.join(EOS_FILES)} (megatron-core's rule): its run took the token named "
                f"{' or '.join(map(repr, EOD_TOKENS))} (else a new id) as eod, id {trained}, where --tokenizer-model "
                f"{tokenizer_model} now gives id {eod}: give --tokenizer-model a directory holding only its "
                f"tokenizer.json (the eod by name, as the run trained){remedy}")
    if trained is not None and trained != eod:
        named = None
        if tokenizer_type == "HuggingFaceTokenizer":
            named = eos_token(tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model))
        raise ValueError(f"{checkpoint} was trained with eod {trained}, --tokenizer-type {tokenizer_type}"
                         + (f" --tokenizer-model {tokenizer_model}" if tokenizer_model else "")
                         + (f" (eos_token {named!r})" if named else "")
                         + f" gives eod {eod}: give the tokenizer files the run used{remedy}")


def eos_token(directory: str) -> Optional[str]:
    """The eos_token (else the sep_token) that transformers reads for a tokenizer in `directory`:
    special_tokens_map.json's over tokenizer_config.json's; None when neither names one."""
    found = {}
    for name in EOS_FILES:  # the later file wins, as in transformers
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path} is not readable JSON: {e}") from None
        for key in ("eos_token", "sep_token"):
            value = content.get(key) if isinstance(content, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found.get("eos_token", found.get("sep_token"))


class NullTokenizer:
    """A vocabulary size and nothing else, for synthetic data; `eod` = vocab_size - 1.

    Args:
        vocab_size: number of token ids (>= 2).
    """

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError(
            "NullTokenizer cannot tokenize text (it is for --mock-data); use ByteLevelTokenizer or "
            "HuggingFaceTokenizer"
        )

    def detokenize(self, ids: Iterable[int]) -> str:
        """Args: ids. Returns: the ids as space-separated numbers (for logging samples)."""
        return " ".join(str(int(i)) for i in ids)


def add_tokenizer_file_arguments(group):
    """--tokenizer-model, --vocab-file, --merge-file (Megatron's flags) on an argparse group: one definition for
    pretrain_gpt.py, tools/preprocess_data.py and tools/checkpoint_convert.py."""
    group.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a tokenizer.json, or the directory holding it "
                                                 "(its tokenizer_config.json names the eos_token, the eod); "
                                                 f"{' / '.join(SENTENCEPIECE_TYPES)}: a SentencePiece .model")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")


def check_tokenizer_flags(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                          vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """Raise ValueError for a file flag the tokenizer type needs and lacks, or is given and would ignore (the data
    would be tokenized, or read, as another tokenizer's ids without any error).

    Args:
        tokenizer_type: a --tokenizer-type name.
        tokenizer_model, vocab_file, merge_file: the flags' values (None: not given).
    """
    if tokenizer_type not in FILE_FLAGS:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choices: {', '.join(TOKENIZER_TYPES)}")
    given = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
    reads = FILE_FLAGS[tokenizer_type]
    for dest, value in given.items():
        if value and dest not in reads:
            readers = [name for name, dests in FILE_FLAGS.items() if dest in dests]
            raise ValueError(f"{_flag(dest)} is read by --tokenizer-type {' / '.join(readers)} only, not by "
                             f"{tokenizer_type}: give one of those types or drop {_flag(dest)}")
    for dest in reads:
        what = _MODEL_HELP.get(tokenizer_type, "") if dest == "tokenizer_model" else ""
        if not given[dest]:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs {_FLAG_HELP[dest]}"
                             + (f" ({what})" if what else ""))
        if dest != "tokenizer_model" or tokenizer_type != "HuggingFaceTokenizer":
            if not os.path.isfile(given[dest]):
                raise ValueError(f"{_flag(dest)} {given[dest]!r}: no such file"
                                 + (f" (expected {what})" if what else ""))
        elif not os.path.exists(given[dest]):
            raise ValueError(f"{_flag(dest)} {given[dest]!r}: no such file or directory (expected {what})")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """Build a tokenizer by Megatron's `--tokenizer-type` name.

    Args:
        tokenizer_type: one of TOKENIZER_TYPES.
        tokenizer_model: --tokenizer-model (the SentencePiece types, HuggingFaceTokenizer).
        vocab_size: the vocabulary size (NullTokenizer only; the others define their own).
        vocab_file, merge_file: GPT-2's vocab.json and merges.txt (GPT2BPETokenizer only).

    Returns:
        An object with `.vocab_size`, `.eod`, `.tokenize(text)` and `.detokenize(ids)`.
    """
    check_tokenizer_flags(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return NullTokenizer(vocab_size)
