"""GPT-2's byte-level BPE from local `vocab.json` and `merges.txt` (nothing is downloaded).

Text is split by GPT-2's pre-tokenisation pattern, each piece's UTF-8 bytes are mapped to
printable characters (the byte-to-unicode table), and merges are applied lowest rank first.
Any text round-trips, since every byte has a token. eod is `<|endoftext|>`.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Sequence

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import Tokenizer

EOD_TOKEN = "<|endoftext|>"
_CONTRACTIONS = r"'s|'t|'re|'ve|'m|'ll|'d"
# Unicode's White_Space property, which `regex` means by \s (Python's `re` adds \x1c-\x1f).
_WHITE_SPACE = "\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CACHE_LIMIT = 200_000  # words; keeps memory bounded on endless streams


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, ...) to 256+n.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _category_class(prefix: str) -> str:
    """A regex character class of every code point whose category starts with `prefix`."""
    ranges: list[tuple[int, int]] = []
    for code in range(0x110000):
        if unicodedata.category(chr(code)).startswith(prefix):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    return "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
        for a, b in ranges
    )


@functools.lru_cache(maxsize=1)
def pretokenizer() -> re.Pattern:
    """GPT-2's pattern; `regex` when installed, else the same classes built from unicodedata."""
    try:
        import regex
    except ImportError:
        letters, numbers, space = _category_class("L"), _category_class("N"), _WHITE_SPACE
        return re.compile(
            rf"{_CONTRACTIONS}| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
            rf"|[{space}]+(?![^{space}])|[{space}]+"
        )
    return regex.compile(
        rf"{_CONTRACTIONS}| ?\p{{L}}+| ?\p{{N}}+| ?[^\s\p{{L}}\p{{N}}]+|\s+(?!\S)|\s+"
    )


def _load_vocab(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as file:
            vocab = json.load(file)
    except json.JSONDecodeError as error:
        raise TokenizerError(
            f"--vocab-file {path}:{error.lineno}: not a JSON vocabulary ({error.msg})"
        ) from None
    except UnicodeDecodeError as error:
        raise TokenizerError(f"--vocab-file {path}: not UTF-8 (byte {error.start})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {path}: expected a JSON object of token -> id")
    return vocab


def _load_merges(path: str) -> dict[tuple[str, str], int]:
    ranks: dict[tuple[str, str], int] = {}
    try:
        with open(path, encoding="utf-8") as file:
            for line_no, line in enumerate(file, 1):
                line = line.rstrip("\r\n")
                if not line or (line_no == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise TokenizerError(
                        f"--merge-file {path}:{line_no}: expected two symbols, got {line!r:.60}"
                    )
                ranks.setdefault((parts[0], parts[1]), len(ranks))
    except UnicodeDecodeError as error:
        raise TokenizerError(f"--merge-file {path}: not UTF-8 (byte {error.start})") from None
    return ranks


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE with GPT-2's files."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._encoder = _load_vocab(vocab_file)
        self._decoder = {i: token for token, i in self._encoder.items()}
        self._ranks = _load_merges(merge_file)
        self._byte_encoder = bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        self._pattern = pretokenizer()
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return max(len(self._encoder), max(self._encoder.values(), default=-1) + 1)

    @property
    def eod(self) -> int:
        if EOD_TOKEN not in self._encoder:
            raise TokenizerError(f"--vocab-file {self.vocab_file}: no {EOD_TOKEN} token for eod")
        return self._encoder[EOD_TOKEN]

    def _merge(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            rank, i = min(
                (self._ranks.get(pair, len(self._ranks)), i)
                for i, pair in enumerate(zip(parts, parts[1:]))
            )
            if rank == len(self._ranks):
                break
            first, second = parts[i], parts[i + 1]
            merged: list[str] = []
            j = 0
            while j < len(parts):
                if j + 1 < len(parts) and parts[j] == first and parts[j + 1] == second:
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return parts

    def _word_ids(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            mapped = "".join(self._byte_encoder[b] for b in word.encode("utf-8"))
            try:
                ids = [self._encoder[piece] for piece in self._merge(mapped)]
            except KeyError as error:
                raise TokenizerError(
                    f"--vocab-file {self.vocab_file}: no id for BPE piece {error.args[0]!r}"
                ) from None
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[word] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self._pattern.findall(text):
            ids.extend(self._word_ids(word))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self._decoder[int(i)] for i in ids)
        data = bytes(self._byte_decoder[c] for c in text if c in self._byte_decoder)
        return data.decode("utf-8", errors="replace")
