"""Build a tokenizer from Megatron's flags (`TokenizerSpec`), checking the files they name."""

from __future__ import annotations

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import TOKENIZER_TYPES, Tokenizer, TokenizerSpec, require_file


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer `spec` describes; TokenizerError naming the flag or file when it cannot."""
    kind = spec.tokenizer_type
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from megapipe.data.tokenizers.sentencepiece_tokenizer import (
            GPTSentencePieceTokenizer,
            SentencePieceTokenizer,
        )

        model = require_file(spec.tokenizer_model, "--tokenizer-model", kind)
        if kind == "GPTSentencePieceTokenizer":
            return GPTSentencePieceTokenizer(model)
        return SentencePieceTokenizer(model, spec.vocab_extra_ids)
    if kind == "GPT2BPETokenizer":
        from megapipe.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

        vocab = require_file(spec.vocab_file, "--vocab-file", kind)
        merges = require_file(spec.merge_file, "--merge-file", kind)
        return GPT2BPETokenizer(vocab, merges)
    if kind == "HuggingFaceTokenizer":
        from megapipe.data.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer

        if not spec.tokenizer_model:
            raise TokenizerError(f"--tokenizer-type {kind} needs --tokenizer-model")
        return HuggingFaceTokenizer(spec.tokenizer_model)
    if kind == "NullTokenizer":
        from megapipe.data.tokenizers.null_tokenizer import NullTokenizer

        if spec.vocab_size is None:
            raise TokenizerError(f"--tokenizer-type {kind} needs --vocab-size")
        return NullTokenizer(spec.vocab_size)
    raise TokenizerError(f"--tokenizer-type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}")
