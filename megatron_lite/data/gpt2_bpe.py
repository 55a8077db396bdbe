"""GPT-2's byte-level BPE (Megatron's `GPT2BPETokenizer`) in plain Python: vocab.json + merges.txt -> ids.

    text --split on '<|endoftext|>'--> pieces --GPT-2's regex--> words --UTF-8 bytes as printable chars-->
    'Ġworld' --merges, lowest rank first--> ['Ġwor', 'ld'] --vocab.json--> [1542, 335]

The regex is GPT-2's, `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`, which
Megatron-LM compiles with the third-party `regex` package (and megatron-core reaches through the `tokenizers`
package). The standard library's `re` has no `\\p{...}`, so the letter / number / space classes are spelled out
from `unicodedata` once per process: letters are categories L*, numbers N*, spaces what `str.isspace()` accepts
except U+001C..U+001F (neither `regex` nor `tokenizers` counts those four as space). The classes follow Python's
Unicode database (3.11: Unicode 14.0): a character assigned by a later Unicode version, which those packages may
know as a letter, is "other" here.

File formats, read as Megatron-LM's gpt2_tokenization.py reads them: vocab.json maps token -> id; merges.txt is
one "left right" pair per line, ranked by line, its first line (`#version: ...`) skipped, and so is its last line
(empty when the file ends with a newline, as GPT-2's does). A token that is not in vocab.json becomes id 0.
"""

import functools
import heapq
import json
import re
import unicodedata
from typing import Dict, List, Tuple

ENDOFTEXT = "<|endoftext|>"


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the other 68
    take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _ranges(predicate) -> str:
    """A regex character-class body for every code point that satisfies `predicate`, as ranges."""
    parts, start, previous = [], None, None
    for code in range(0x110000):
        if predicate(code):
            if start is None:
                start = code
            previous = code
        elif start is not None:
            parts.append(re.escape(chr(start)) + ("" if previous == start else "-" + re.escape(chr(previous))))
            start = None
    if start is not None:
        parts.append(re.escape(chr(start)) + ("" if previous == start else "-" + re.escape(chr(previous))))
    return "".join(parts)


@functools.lru_cache(maxsize=None)
def gpt2_pattern() -> "re.Pattern":
    """GPT-2's pre-tokenization regex for `re` (built once per process: about a second)."""
    categories = [unicodedata.category(chr(code))[0] for code in range(0x110000)]
    letters = _ranges(lambda code: categories[code] == "L")
    numbers = _ranges(lambda code: categories[code] == "N")
    spaces = _ranges(lambda code: chr(code).isspace() and not 0x1C <= code <= 0x1F)
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{spaces}{letters}{numbers}]+"
                      rf"|[{spaces}]+(?![^{spaces}])|[{spaces}]+")


def read_vocab(path: str, flag: str = "--vocab-file") -> Dict[str, int]:
    """vocab.json as {token: id}. Raises ValueError naming `flag` when it is not a JSON object of ids."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{flag} {path!r} is not a GPT-2 vocab.json (a JSON object token -> id): {e}") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ValueError(f"{flag} {path!r} is not a GPT-2 vocab.json (a JSON object token -> id); a merges.txt "
                         f"goes to --merge-file, a tokenizer.json to --tokenizer-model")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{flag} {path!r}: the ids are not 0..{len(vocab) - 1} (each once), so the vocabulary "
                         f"size Megatron takes, len(vocab) = {len(vocab)}, does not hold them")
    return vocab


def read_merges(path: str, flag: str = "--merge-file") -> Dict[Tuple[str, str], int]:
    """merges.txt as {(left, right): rank}. Raises ValueError naming `flag` when a line is not a pair."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path!r} is not a GPT-2 merges.txt: {e}") from None
    if not text.startswith("#"):  # Megatron-LM would drop the first merge (or read a vocab.json as no merges)
        raise ValueError(f"{flag} {path!r} is not a GPT-2 merges.txt: its first line {text[:40]!r} is not the "
                         f"'#version: ...' header (a vocab.json goes to --vocab-file)")
    lines = text.split("\n")[1:-1]  # Megatron-LM's reading: the header and the last line dropped
    merges = [tuple(line.split()) for line in lines]
    for number, merge in enumerate(merges, 2):
        if len(merge) not in (0, 2):
            raise ValueError(f"{flag} {path!r} line {number}: {lines[number - 2][:60]!r} is not a 'left right' "
                             f"merge (is it a GPT-2 merges.txt? a vocab.json goes to --vocab-file)")
    return {merge: rank for rank, merge in enumerate(merges)}


def merge(symbols: List[str], ranks: Dict[Tuple[str, str], int]) -> List[str]:
    """Megatron-LM's BPE merge order: the adjacent pair of lowest rank, every occurrence of it left to right (of
    'a a a', the first two), then again, until no adjacent pair is ranked. Its loop rescans the word after each
    merge, O(length x merges applied); here the symbols form a linked list, the positions of each ranked pair a
    set and the pairs a heap of ranks, O(length log length) (a 32 KB word without spaces: 0.06 s, not 26 s).

    Args:
        symbols: the word's characters (bytes as GPT-2's printable characters).
        ranks: {(left, right): rank}.
    Returns:
        The merged tokens.
    """
    if len(symbols) < 2:
        return symbols
    following = [*range(1, len(symbols)), -1]
    preceding = list(range(-1, len(symbols) - 1))
    where: Dict[Tuple[str, str], set] = {}  # pair -> the positions of its left symbol
    heap: List[Tuple[int, Tuple[str, str]]] = []

    def add(i):  # the pair at i (a position with a successor) and, if ranked, its place in the heap
        pair = (symbols[i], symbols[following[i]])
        rank = ranks.get(pair)
        if rank is not None:
            if not where.get(pair):  # else an entry is in the heap already
                heapq.heappush(heap, (rank, pair))
            where.setdefault(pair, set()).add(i)

    def drop(i):
        positions = where.get((symbols[i], symbols[following[i]]))
        if positions:
            positions.discard(i)

    for i in range(len(symbols) - 1):
        add(i)
    while heap:
        _, pair = heapq.heappop(heap)
        for i in sorted(where.pop(pair, ())):
            j = following[i]
            if symbols[i] != pair[0] or j < 0 or symbols[j] != pair[1]:
                continue  # absorbed by this pair's previous merge (an overlap, 'a a a')
            left, right = preceding[i], following[j]
            if left >= 0:
                drop(left)
            if right >= 0:
                drop(j)
            # A new pair holds the merged symbol, so it is never `pair` itself: this loop's positions stay valid.
            symbols[i], symbols[j] = pair[0] + pair[1], None
            following[i] = right
            if right >= 0:
                preceding[right] = i
                add(i)
            if left >= 0:
                add(left)
    merged, i = [], 0
    while i >= 0:
        merged.append(symbols[i])
        i = following[i]
    return merged


class GPT2BPE:
    """Byte-level BPE over GPT-2 files: `encode(text)` -> ids (no special token is matched in text).

    Args:
        vocab: {token: id} (read_vocab).
        merges: {(left, right): rank} (read_merges).
    """

    def __init__(self, vocab: Dict[str, int], merges: Dict[Tuple[str, str], int]):
        self.encoder = vocab
        self.decoder = {i: token for token, i in vocab.items()}
        self.ranks = merges
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = gpt2_pattern()
        self._cache: Dict[str, List[str]] = {}

    def _bpe(self, word: str) -> List[str]:
        if word in self._cache:
            return self._cache[word]
        parts = merge(list(word), self.ranks)
        if len(self._cache) < 100_000:
            self._cache[word] = parts
        return parts

    def encode(self, text: str) -> List[int]:
        """Args: text. Returns: its ids (a token missing from vocab.json is 0, as in Megatron-LM)."""
        ids = []
        for word in self.pattern.findall(text):
            chars = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder.get(token, 0) for token in self._bpe(chars))
        return ids

    def decode(self, ids) -> str:
        """Args: ids in the vocabulary. Returns: the text (invalid UTF-8 becomes U+FFFD)."""
        chars = "".join(self.decoder.get(int(i), "") for i in ids)
        return bytes(self.byte_decoder[c] for c in chars if c in self.byte_decoder).decode("utf-8", errors="replace")
