"""A small rule-based sentence splitter for `--split-sentences` (no NLTK download needed).

Splits after `.`, `!` or `?` (and closing quotes or brackets) followed by whitespace and an
upper-case letter, digit or opening quote, unless the word before is a common abbreviation or
an initial; blank lines always end a sentence. It is simpler than NLTK's punkt, which Megatron
uses, so sentence boundaries (not the tokens of a document) can differ from Megatron's.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r"[.!?][\"')\]]*(\s+)(?=[\"'(\[]?[A-Z0-9])|\n\s*\n\s*")
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf", "al"}
    | {"fig", "no", "vol", "ch", "sec", "approx", "dept", "inc", "ltd"}
)


def _is_abbreviation(text: str, end: int) -> bool:
    """Whether the word ending at `end` (just before the full stop) is an abbreviation."""
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:end].lstrip("\"'([").lower()
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text`, non-empty. With keep_newlines, each keeps its trailing
    whitespace (so newlines survive a round trip); otherwise sentences are stripped."""
    pieces: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if match.group(1) is not None:
            if text[match.start()] == "." and _is_abbreviation(text, match.start()):
                continue
            cut = match.start(1)
        else:
            cut = match.start()
        end = match.end() if keep_newlines else cut
        pieces.append(text[start:end])
        start = match.end()
    pieces.append(text[start:])
    if keep_newlines:
        return [piece for piece in pieces if piece.strip()]
    return [piece.strip() for piece in pieces if piece.strip()]
