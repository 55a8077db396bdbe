"""Tokenizers behind one small interface: `vocab_size`, `eod`, `tokenize(text)`, `detokenize(ids)`.

  * `ByteLevelTokenizer`: built in, nothing to download. Token ids are the UTF-8 bytes 0..255 of the
    text, `eod` is 256, so `vocab_size` is 257. Every string round-trips exactly.
  * `HuggingFaceTokenizer`: any local `tokenizer.json` through the optional `tokenizers` package.
  * `NullTokenizer`: only a vocabulary size, for `--mock-data` (it cannot read text).

`detokenize` drops `eod` in all of them, so a document's ids (stored with `eod` appended) turn back into
exactly its text. The trainer, not the tokenizer, pads the vocabulary for the embedding table
(Megatron's `--make-vocab-size-divisible-by`).
"""

import os
from typing import Iterable, List, Optional

TOKENIZER_TYPES = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer")

EOD_TOKENS = ("<|endoftext|>", "</s>")
"""Tokens that `HuggingFaceTokenizer` takes as end-of-document, first match wins (GPT-2 style, then T5/Llama)."""


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


class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local tokenizer.json (no download, no `transformers`).

    Args:
        tokenizer_model: path to a tokenizer.json file.
    """

    def __init__(self, tokenizer_model: Optional[str]):
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model PATH (a local tokenizer.json)")
        if not os.path.isfile(tokenizer_model):
            raise ValueError(f"--tokenizer-model {tokenizer_model!r}: no such file (expected a tokenizer.json)")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ValueError(
                "HuggingFaceTokenizer needs the optional 'tokenizers' package (pip install -e \".[hf]\", the "
                "Hugging Face extra, or pip install tokenizers); "
                "ByteLevelTokenizer needs nothing"
            ) from e
        self.tokenizer_model = tokenizer_model
        try:
            self._tokenizer = Tokenizer.from_file(tokenizer_model)
        except Exception as e:  # the Rust library's error (not JSON, not a tokenizer), without the file's name
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} is not a tokenizer.json that the 'tokenizers' "
                             f"package can read: {e}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
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


def check_tokenizer_model(tokenizer_type: str, tokenizer_model: Optional[str]):
    """Raise ValueError for a tokenizer.json given with a tokenizer type that would ignore it (the data would be
    tokenized, or read, as another tokenizer's ids without any error)."""
    if tokenizer_model and tokenizer_type != "HuggingFaceTokenizer":
        raise ValueError(f"--tokenizer-model is read by --tokenizer-type HuggingFaceTokenizer only, not by "
                         f"{tokenizer_type}: add --tokenizer-type HuggingFaceTokenizer or drop --tokenizer-model")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None):
    """Build a tokenizer by Megatron's `--tokenizer-type` name.

    Args:
        tokenizer_type: one of TOKENIZER_TYPES.
        tokenizer_model: path to a tokenizer.json (HuggingFaceTokenizer only).
        vocab_size: the vocabulary size (NullTokenizer only; the others define their own).

    Returns:
        An object with `.vocab_size`, `.eod`, `.tokenize(text)` and `.detokenize(ids)`.
    """
    check_tokenizer_model(tokenizer_type, tokenizer_model)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choices: {', '.join(TOKENIZER_TYPES)}")
