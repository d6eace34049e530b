"""Tokenize a JSONL corpus into Megatron's indexed dataset format (.bin/.idx), version 1.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 2

writes data/corpus_text_document.bin/.idx (one pair per --json-keys key). Bad lines (malformed
JSON, non-UTF-8 bytes, a missing key, an empty document) are skipped and reported with their
line numbers; --strict makes the first one fatal. Outputs appear only when complete. Errors are
one line (exit 1; bad flags exit 2); --debug adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapipe.data.jsonl import MAX_LINE_BYTES
from megapipe.data.preprocess import PreprocessOptions, preprocess
from megapipe.data.tool_cli import OneLineParser, add_tokenizer_args, run_tool, tokenizer_spec

PROG = "preprocess_data.py"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="Path to the input JSONL file.")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys to extract from each JSON line."
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="Split documents into sentences."
    )
    group.add_argument(
        "--keep-newlines", action="store_true", help="Keep newlines between sentences."
    )
    group.add_argument("--lang", default="english", help="Accepted for Megatron compatibility.")
    add_tokenizer_args(parser)
    parser.add_argument(
        "--append-eod", action="store_true", help="Append an <eod> token to each document."
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="Output prefix, without _{key}_document."
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Worker processes to tokenize.")
    group.add_argument(
        "--log-interval", type=int, default=1000, help="Documents between progress lines."
    )
    group.add_argument(
        "--strict", action="store_true", help="Fail on the first bad input line (no output)."
    )
    group.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        help="Skip (with --strict: refuse) input lines longer than this, without reading them "
        "whole. Default: 1 GiB.",
    )
    group.add_argument("--quiet", action="store_true", help="No progress output.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=tokenizer_spec(args),
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        workers=args.workers,
        strict=args.strict,
        log_interval=args.log_interval,
        max_line_bytes=args.max_line_bytes,
    )
    report = preprocess(options, show_progress=not args.quiet)
    if report.issues is not None and report.issues.total:
        print(f"{PROG}: warning: {report.issues.summary(report.lines)}", file=sys.stderr)
    print(f"{PROG}: {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(PROG, main))
