"""Tokenizers behind one interface, chosen with Megatron's --tokenizer-type; nothing downloads."""

from megapipe.data.tokenizers.base import TOKENIZER_TYPES, Tokenizer, TokenizerSpec
from megapipe.data.tokenizers.factory import build_tokenizer

__all__ = ["TOKENIZER_TYPES", "Tokenizer", "TokenizerSpec", "build_tokenizer"]
