"""A Hugging Face `tokenizer.json` (or a local tokenizer directory holding one), loaded offline.

Needs the optional `tokenizers` package (`pip install tokenizers`, or megapipe's `hf` extra).
Special tokens come from `tokenizer_config.json` beside the file when present (eos -> eod,
pad), else from well-known names among the tokenizer's added tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import Tokenizer

_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")


def _resolve(path: str) -> str:
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise TokenizerError(f"--tokenizer-model {path}: directory has no tokenizer.json")
        return candidate
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer-model {path}: no such file or directory")
    return path


def _token_name(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerError(f"{path}: not a JSON tokenizer config ({error})") from None
    return config if isinstance(config, dict) else {}


class HuggingFaceTokenizer(Tokenizer):
    """Encodes as `transformers` does by default (the tokenizer's post-processor applies)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package: "
                "pip install tokenizers"
            ) from None
        self.path = _resolve(path)
        try:
            self._tok = HFTokenizer.from_file(self.path)
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(
                f"--tokenizer-model {self.path}: not a tokenizer.json ({error})"
            ) from None
        directory = os.path.dirname(self.path)
        self._config = _read_config(os.path.join(directory, "tokenizer_config.json"))

    def _special(self, key: str, fallbacks: Sequence[str]) -> int | None:
        names = [_token_name(self._config.get(key)), *fallbacks]
        for name in names:
            if name is not None and (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def eod(self) -> int:
        eos = self._special("eos_token", _EOS_NAMES)
        if eos is None:
            raise TokenizerError(
                f"{self.path}: no end-of-document token found (set eos_token in "
                "tokenizer_config.json)"
            )
        return eos

    @property
    def pad(self) -> int:
        pad = self._special("pad_token", _PAD_NAMES)
        return -1 if pad is None else pad
