"""Write a JSONL corpus of real English from text that ships with Python (no download).

    python tools/make_demo_corpus.py --output demo.jsonl              # ~2 MB, all sources
    python tools/make_demo_corpus.py --output demo.jsonl --max-mb 0.5  # a quick one

Each line is {"text": ..., "source": ...}: the pydoc topics behind help(), then stdlib
docstrings (one document per module). Feed it to tools/train_tokenizer.py and
tools/preprocess_data.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from megapipe.atomic_files import atomic_write
from megapipe.data.demo_corpus import demo_documents
from megapipe.data.errors import DataError
from megapipe.data.tool_cli import run_tool

PROG = "make_demo_corpus.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="Path of the JSONL file to write.")
    parser.add_argument(
        "--max-mb", type=float, default=None, help="Stop after about this many MB of text."
    )
    parser.add_argument(
        "--topics-only", action="store_true", help="Only pydoc topics (fast, ~0.5 MB)."
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    max_chars = None if args.max_mb is None else int(args.max_mb * 1e6)
    documents = chars = 0
    try:
        with atomic_write(args.output) as temp, open(temp, "w", encoding="utf-8") as file:
            for document in demo_documents(max_chars, docstrings=not args.topics_only):
                file.write(json.dumps(document, ensure_ascii=False) + "\n")
                documents += 1
                chars += len(document["text"])
    except FileNotFoundError as error:
        raise DataError(f"--output {args.output}: {error.strerror}") from None
    print(f"{PROG}: wrote {documents} documents ({chars / 1e6:.2f} M characters) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(PROG, main))
