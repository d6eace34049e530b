"""Merge Megatron indexed datasets into one .bin/.idx pair.

    python tools/merge_datasets.py --input DIR --output-prefix merged       # every pair in DIR
    python tools/merge_datasets.py --datasets a_text_document b_text_document --output-prefix m

Documents keep their order (datasets in sorted order for --input, as Megatron's tool). All inputs
must share one token dtype. The output appears only when complete.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megapipe.data.merge import merge_datasets, prefixes_in
from megapipe.data.tool_cli import run_tool

PROG = "merge_datasets.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="Directory whose .bin/.idx pairs are merged.")
    source.add_argument("--datasets", nargs="+", help="Dataset prefixes to merge, in order.")
    parser.add_argument("--output-prefix", required=True, help="Writes PREFIX.bin/.idx.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefixes = prefixes_in(args.input) if args.input else list(args.datasets)
    merged = merge_datasets(prefixes, args.output_prefix)
    print(
        f"{PROG}: merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx "
        f"({merged.num_documents} documents, {merged.num_tokens} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(PROG, main))
