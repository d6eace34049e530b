"""Megatron's NullTokenizer: the text is the ids, space-separated; eod is `vocab_size`.

For tests and benchmarks that need a tokenizer without a model file.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import Tokenizer


class NullTokenizer(Tokenizer):
    """Ids 0..vocab_size-1 written as decimal text; one extra id, vocab_size, is the eod."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= 0:
            raise TokenizerError(f"NullTokenizer needs a positive --vocab-size, got {vocab_size}")
        self._size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._size + 1  # the ids plus the eod, as Megatron's

    @property
    def eod(self) -> int:
        return self._size

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise TokenizerError(f"NullTokenizer expects integers: {error}") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"NullTokenizer id {i} outside 0..{self.vocab_size - 1}")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
