"""What the data tools share on the command line: tokenizer flags and one-line error exits."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import NoReturn

from megapipe.data.tokenizers import TOKENIZER_TYPES, TokenizerSpec
from megapipe.errors import run_cli


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`prog: error: ... (see --help)`), exit 2,
    instead of the usage block and then the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_tokenizer_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Megatron's tokenizer flags."""
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type",
        required=required,
        choices=TOKENIZER_TYPES,
        help="What type of tokenizer to use.",
    )
    group.add_argument(
        "--tokenizer-model", help="SentencePiece model, or HF tokenizer.json / directory."
    )
    group.add_argument("--vocab-file", help="Path to the GPT-2 vocab.json.")
    group.add_argument("--merge-file", help="Path to the GPT-2 merges.txt.")
    group.add_argument("--vocab-size", type=int, help="Vocabulary size for NullTokenizer.")
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="<extra_id_N> tokens (SentencePiece)."
    )


def tokenizer_spec(args: argparse.Namespace) -> TokenizerSpec:
    return TokenizerSpec(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        vocab_extra_ids=args.vocab_extra_ids,
    )


def run_tool(prog: str, main: Callable[[Sequence[str] | None], int], argv=None) -> int:
    """Run `main`; bad data (any megapipe error, status 1 for a DataError) or a full disk
    (OSError, status 1) becomes one line on stderr and no output (`--debug`, taken out of argv
    here, prints the traceback first), Ctrl-C status 130."""
    return run_cli(prog, main, argv, also=(OSError,), interrupted="interrupted; no output written")
