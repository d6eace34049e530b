"""Check the data flags up front, on every rank, before any process group exists.

Loads the tokenizer (whose size becomes the model's vocabulary), opens and validates every
dataset the flags name, checks that the training split (and, when evaluation will run, the
validation and test splits) holds tokens and that the cache directory is usable, so that a
bad path or file is a one-line error at start-up rather than a traceback from the middle of
training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megapipe.config import DataConfig
from megapipe.data.blending import parse_blend
from megapipe.data.errors import DataError
from megapipe.data.gpt_builder import SplitSource, check_split_source, split_source, train_source
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.splits import parse_split
from megapipe.data.tokenizers import Tokenizer, TokenizerSpec, build_tokenizer


@dataclass(frozen=True)
class DataCheck:
    vocab_size: int | None  # None: mock data without a tokenizer or --vocab-size
    notes: tuple[str, ...] = ()


def tokenizer_spec(data: DataConfig) -> TokenizerSpec | None:
    if data.tokenizer_type is None:
        return None
    return TokenizerSpec(
        tokenizer_type=data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        vocab_size=data.vocab_size,
    )


def data_tokenizer(data: DataConfig) -> Tokenizer | None:
    spec = tokenizer_spec(data)
    return None if spec is None else build_tokenizer(spec)


def _check_cache_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"--data-cache-path {path}: exists and is not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--data-cache-path {path}: {existing} is not writable")


def data_split_source(data: DataConfig, name: str) -> SplitSource | None:
    """Where split `name` ("train", "valid", "test") of these flags comes from, or None."""
    per_split = {
        "train": data.train_data_path,
        "valid": data.valid_data_path,
        "test": data.test_data_path,
    }
    if name == "train":
        return train_source(data.data_path, data.split, data.train_data_path)
    return split_source(
        name, data_path=data.data_path, split=data.split, split_data_path=per_split[name]
    )


def check_data_config(data: DataConfig, *, needs_eval: bool = False) -> DataCheck:
    """Everything about the data flags that can be checked cheaply; raises DataError.

    With `needs_eval` (evaluation will run: --eval-iters above 0), the valid and test splits
    that exist must hold documents too: a share of --split that rounds to no documents is an
    error naming the split and the --split value. A zero share is not: that split is skipped.
    """
    notes: list[str] = []
    tokenizer = data_tokenizer(data)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else data.vocab_size
    if (
        tokenizer is not None
        and data.vocab_size is not None
        and data.tokenizer_type != "NullTokenizer"
    ):
        notes.append(
            f"--vocab-size ({data.vocab_size}) is ignored: the vocabulary size comes from "
            f"--tokenizer-type {data.tokenizer_type} ({vocab_size})"
        )
    masks = [data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask]
    if any(masks):
        if data.mock_data:
            notes.append(
                "--eod-mask-loss/--reset-position-ids/--reset-attention-mask have no effect with "
                "--mock-data (its samples hold no end-of-document tokens)"
            )
        elif tokenizer is not None:
            _ = tokenizer.eod  # raises when the tokenizer has no end-of-document token
    if data.real_data:
        check_split_source(data_split_source(data, "train"))
        for name in ("valid", "test"):
            source = data_split_source(data, name)
            if source is None:
                continue
            if needs_eval:
                check_split_source(source)
            else:
                for prefix in parse_blend(source.words, source.flag)[0]:
                    IndexedDataset(prefix)  # exists and is valid, even if not read
    elif needs_eval:
        parse_split(data.split)  # mock data follows --split's shares too
    if data.data_cache_path is not None:
        _check_cache_dir(data.data_cache_path)
    return DataCheck(vocab_size, tuple(notes))
