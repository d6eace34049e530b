"""Train a SentencePiece tokenizer (BPE or unigram) for GPT from JSONL or plain text.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok --vocab-size 8000

writes tok.model and tok.vocab; use them with --tokenizer-type GPTSentencePieceTokenizer
--tokenizer-model tok.model (eod = </s>, id 2; pad = <pad>, id 3). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapipe.data.tokenizer_training import TokenizerTrainingOptions, train_sentencepiece
from megapipe.data.tool_cli import run_tool

PROG = "train_tokenizer.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL or text files.")
    parser.add_argument(
        "--input-format", choices=("auto", "jsonl", "text"), default="auto",
        help="auto: JSONL for .jsonl/.json/.ndjson files, else one sentence per line.",
    )  # fmt: skip
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="Keys holding text.")
    parser.add_argument("--output-prefix", required=True, help="Writes PREFIX.model/.vocab.")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument(
        "--no-byte-fallback", dest="byte_fallback", action="store_false",
        help="Map unknown characters to <unk> instead of UTF-8 byte tokens.",
    )  # fmt: skip
    parser.add_argument(
        "--user-defined-symbols", nargs="*", default=[], help="Extra special tokens."
    )
    parser.add_argument("--max-sentence-length", type=int, default=16384, help="In bytes.")
    parser.add_argument(
        "--input-sentence-size", type=int, default=0, help="Sample this many lines (0: all)."
    )
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--strict", action="store_true", help="Fail on the first bad line.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = train_sentencepiece(
        TokenizerTrainingOptions(
            inputs=tuple(args.input),
            output_prefix=args.output_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            input_format=args.input_format,
            json_keys=tuple(args.json_keys),
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            user_defined_symbols=tuple(args.user_defined_symbols),
            max_sentence_length=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size,
            num_threads=args.num_threads,
            seed=args.seed,
            strict=args.strict,
        )
    )
    for log in report.issues:
        if log.total:
            print(f"{PROG}: warning: {log.summary()}", file=sys.stderr)
    print(f"{PROG}: trained on {report.sentences} lines; wrote {report.model_path}, "
          f"{report.vocab_path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(PROG, main))
