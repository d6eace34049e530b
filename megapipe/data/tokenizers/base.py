"""The interface every tokenizer offers, and the settings that choose and build one.

Names follow Megatron-LM: `vocab_size`, `tokenize`, `detokenize`, `eod` (the end-of-document
id appended by preprocessing and used by --eod-mask-loss and friends) and `pad` (-1 when the
tokenizer has none, as SentencePiece reports it).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.data.errors import TokenizerError

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What `--tokenizer-type` and its companion flags say; picklable, so workers rebuild it."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer only
    vocab_extra_ids: int = 0  # SentencePieceTokenizer only


class Tokenizer(ABC):
    """Text <-> token ids."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model must embed (every id `tokenize` can return is below it)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize many texts; tokenizers with a native batch path override this."""
        return [self.tokenize(text) for text in texts]

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document id; raises TokenizerError when the tokenizer has none."""

    @property
    def pad(self) -> int:
        return -1


def require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    """`path` if it names an existing file; else a TokenizerError naming the flag and path."""
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "no such file"
        raise TokenizerError(f"{flag} {path}: {what}")
    return path
