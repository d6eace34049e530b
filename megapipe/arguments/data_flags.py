"""Flags for datasets, tokenizers and masking, and the DataConfig they make."""

from __future__ import annotations

import argparse

from megapipe.config import DataConfig
from megapipe.errors import ConfigError

NO_DATASET = "no dataset: pass --mock-data, --data-path or --train-data-path"


def add_data_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--mock-data",
        action="store_true",
        help="Train on synthetic data (needs --vocab-size or --tokenizer-type).",
    )
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefix(es) (PREFIX.bin/.idx), optionally weighted: `0.3 A 0.7 B` blends A "
        "and B by weight. Split into train/valid/test by --split.",
    )
    group.add_argument(
        "--split",
        default="969, 30, 1",
        help="Train/valid/test proportions of each --data-path dataset, e.g. 969,30,1 "
        "(normalised). Default: 969, 30, 1.",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"Dataset prefix(es), optionally weighted, used whole for the {split} split "
            "(instead of --data-path and --split).",
        )
    group.add_argument(
        "--data-cache-path",
        default=None,
        help="Directory for the cached dataset indices (.npy), built once by global rank 0. "
        "Default: build in memory on every rank.",
    )
    group.add_argument(
        "--tokenizer-type",
        default=None,
        help="SentencePieceTokenizer, GPTSentencePieceTokenizer, GPT2BPETokenizer, "
        "HuggingFaceTokenizer or NullTokenizer. Its vocabulary size becomes the model's.",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece model file, or a Hugging Face tokenizer.json or directory.",
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json.")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt.")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Size of the vocabulary: with --mock-data and no tokenizer, or for NullTokenizer.",
    )
    group.add_argument(
        "--eod-mask-loss", action="store_true", help="Mask the loss where the input is the eod."
    )
    group.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="Restart position ids after each end-of-document token.",
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="Attend only within a document (a per-document causal mask).",
    )


def data_config(args: argparse.Namespace) -> tuple[DataConfig, int, list[str]]:
    """The data flags as a DataConfig, checked against the files they name; also returns the
    vocabulary size (the tokenizer's, else --vocab-size) and notes for the user."""
    from megapipe.arguments.validation import validate_data
    from megapipe.data.config_check import check_data_config
    from megapipe.data.errors import DataError

    notes: list[str] = []
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None and args.vocab_file and args.merge_file:
        # Megatron-LM's own GPT-3 example passes vocab and merges files without a type.
        tokenizer_type = "GPT2BPETokenizer"
        notes.append(
            "--vocab-file and --merge-file without --tokenizer-type: using GPT2BPETokenizer"
        )
    data = DataConfig(
        mock_data=args.mock_data,
        data_path=tuple(args.data_path or ()),
        split=args.split,
        train_data_path=tuple(args.train_data_path or ()),
        valid_data_path=tuple(args.valid_data_path or ()),
        test_data_path=tuple(args.test_data_path or ()),
        data_cache_path=args.data_cache_path,
        tokenizer_type=tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
    )
    if not (data.mock_data or data.real_data):
        raise ConfigError(NO_DATASET)
    validate_data(data)
    try:
        check = check_data_config(data, needs_eval=args.eval_iters > 0)
    except DataError as error:
        raise ConfigError(str(error)) from None
    if check.vocab_size is None:
        raise ConfigError(
            "--mock-data needs --vocab-size (or --tokenizer-type, whose vocabulary size is used)"
        )
    return data, check.vocab_size, notes + list(check.notes)
