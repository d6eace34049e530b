"""Generate text from a megapipe checkpoint, on one process or under torchrun with TP and PP.

    python tools/generate_text.py --load CKPT --prompt "Once upon a time" --max-new-tokens 32
    torchrun --nproc_per_node 4 tools/generate_text.py --load CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --prompts-file prompts.txt --top-p 0.9 --seed 7 --output-file out.jsonl

Greedy with --greedy, else sampling (--temperature, --top-k or --top-p, seeded by --seed). A
sequence stops at the tokenizer's EOD or after --max-new-tokens. Prompts come from --prompt
(repeatable) and --prompts-file (one per line). Rank 0 prints each prompt with its continuation
and, with --output-file, writes one JSON record per prompt; a summary of tokens per second goes
to stderr. With a run that had no tokenizer (or NullTokenizer) prompts and outputs are token
ids, space-separated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megapipe.atomic_files import atomic_write  # noqa: E402
from megapipe.console import say  # noqa: E402
from megapipe.data.tokenizers.base import Tokenizer  # noqa: E402
from megapipe.data.tokenizers.null_tokenizer import NullTokenizer  # noqa: E402
from megapipe.data.tool_cli import OneLineParser  # noqa: E402
from megapipe.errors import run_cli  # noqa: E402
from megapipe.inference.generation import GenerationError, generate  # noqa: E402
from megapipe.inference.session import (  # noqa: E402
    add_model_flags,
    add_sampling_flags,
    sampling_options,
    start_session,
)

PROG = "generate_text.py"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    add_sampling_flags(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    group.add_argument("--prompts-file", help="A file of prompts, one per line.")
    group.add_argument("--max-new-tokens", type=int, default=32)
    group.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="Recompute the whole prefix at each step (slow; for comparison).",
    )
    group.add_argument("--output-file", help="Write one JSON record per prompt (rank 0).")
    return parser


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then the lines of --prompts-file (blank lines skipped)."""
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as file:
                prompts += [line.rstrip("\n") for line in file if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise GenerationError(f"--prompts-file {args.prompts_file}: {error}") from None
    if not prompts:
        raise GenerationError("no prompt: give --prompt TEXT or --prompts-file FILE")
    return prompts


def continuation(tokenizer: Tokenizer, prompt: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `prompt`, decoded together with it so that the first new
    word keeps its leading space (SentencePiece drops it when a piece is decoded alone)."""
    if isinstance(tokenizer, NullTokenizer):
        return tokenizer.detokenize(tokens)
    head, whole = tokenizer.detokenize(prompt), tokenizer.detokenize(prompt + tokens)
    return whole[len(head) :] if whole.startswith(head) else tokenizer.detokenize(tokens)


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of the job; returns its exit status: any megapipe error is one line on stderr
    and status 2 (`--debug`: the traceback first)."""
    return run_cli(PROG, _main, argv, status=2)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    options = sampling_options(args)
    prompts = read_prompts(args)
    if args.max_new_tokens < 0:
        raise GenerationError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    session = start_session(args)
    ids = [session.tokenize(text) for text in prompts]
    start = time.perf_counter()
    results = generate(session.model, ids, args.max_new_tokens, options, eod=session.eod,
                       seed=args.seed, use_cache=not args.no_kv_cache)  # fmt: skip
    seconds = time.perf_counter() - start
    if session.state.rank != 0:
        return 0
    records = []
    between = " " if isinstance(session.tokenizer, NullTokenizer) else ""  # ids: space-separated
    for text, prompt_ids, result in zip(prompts, ids, results):
        completion = continuation(session.tokenizer, prompt_ids, result.tokens)
        print(f"{text}{between}{completion}\n")
        record = {"prompt": text, "text": completion, "prompt_tokens": prompt_ids}
        records.append({**record, "tokens": result.tokens, "stopped_at_eod": result.stopped_at_eod})
    new = sum(len(r.tokens) for r in results)
    cache = "without the KV cache" if args.no_kv_cache else "with the KV cache"
    say(f"generated {new} tokens for {len(prompts)} prompts in {seconds:.2f} s "
               f"({new / max(seconds, 1e-9):.1f} tokens/s, {cache})")  # fmt: skip
    if args.output_file:
        with atomic_write(args.output_file) as temp:
            temp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
