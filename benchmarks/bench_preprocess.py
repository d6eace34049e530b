"""Preprocessing throughput against the tokenizer's own raw throughput on the same text.

Builds a JSONL corpus of real English (Python's pydoc topics and stdlib docstrings, repeated to
--corpus-mb), trains a SentencePiece BPE model on it, then times on the same documents:

- raw: `SentencePieceProcessor.encode` over the list of texts, in memory, one thread (the
  tokenizer alone: no file reading, JSON, arrays or writing);
- preprocess_data with --workers 1 and 2: the whole tool path (read, parse, tokenize, write
  .bin/.idx, fsync, rename), --append-eod.

Each is repeated --repeats times and the median reported; the ratio column is preprocess MB/s
over raw MB/s (1.0 = the tool costs nothing beyond tokenizing).

    python benchmarks/bench_preprocess.py            # ~2 min on 2 cores
    python benchmarks/bench_preprocess.py --quick    # ~20 s smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

import sentencepiece as spm

from megapipe.atomic_files import write_json
from megapipe.data.demo_corpus import demo_documents
from megapipe.data.preprocess import PreprocessOptions, preprocess
from megapipe.data.tokenizer_training import TokenizerTrainingOptions, train_sentencepiece
from megapipe.data.tokenizers import TokenizerSpec

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "preprocess.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", type=float, default=16.0, help="corpus size (text repeated)")
    p.add_argument("--source-mb", type=float, default=None, help="distinct text (default: all)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quick", action="store_true", help="2 MB corpus, 1 repeat")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    args = p.parse_args(argv)
    if args.quick:
        args.corpus_mb, args.source_mb, args.repeats = 2.0, 0.6, 1
    return args


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the preprocessing workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_corpus(path: str, corpus_mb: float, source_mb: float | None) -> list[str]:
    limit = None if source_mb is None else int(source_mb * 1e6)
    source = [d["text"] for d in demo_documents(limit)]
    texts: list[str] = []
    size = 0
    while size < corpus_mb * 1e6:
        for text in source:
            texts.append(text)
            size += len(text.encode())
    with open(path, "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    return texts


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megapipe-bench-") as work:
        corpus = os.path.join(work, "corpus.jsonl")
        texts = write_corpus(corpus, args.corpus_mb, args.source_mb)
        text_mb = sum(len(t.encode()) for t in texts) / 1e6
        file_mb = os.path.getsize(corpus) / 1e6
        model = train_sentencepiece(
            TokenizerTrainingOptions(
                inputs=(corpus,),
                output_prefix=os.path.join(work, "tok"),
                vocab_size=args.vocab_size,
                input_sentence_size=200_000,
            )
        ).model_path
        processor = spm.SentencePieceProcessor(model_file=model)

        spec = TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=model)
        runs: dict[str, Callable[[int], object]] = {
            "raw tokenizer (1 thread)": lambda _: processor.encode(texts, num_threads=1)
        }
        for workers in args.workers:
            runs[f"preprocess_data --workers {workers}"] = lambda r, w=workers: preprocess(
                PreprocessOptions(
                    corpus, os.path.join(work, f"out{w}_{r}"), spec, append_eod=True, workers=w
                ),
                show_progress=False,
            )
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        load_before = os.getloadavg()[0]
        for repeat in range(args.repeats):  # rotate the order each round: drift hits all alike
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                cpu_start, start = _cpu_seconds(), time.perf_counter()
                runs[name](repeat)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(_cpu_seconds() - cpu_start)
        load_after = os.getloadavg()[0]
        tokens = sum(len(ids) for ids in processor.encode(texts, num_threads=1))
        rows = [
            (name, statistics.median(wall[name]), statistics.median(cpu[name])) for name in names
        ]
        raw, raw_cpu = rows[0][1], rows[0][2]

    print(
        f"preprocess benchmark: {len(texts)} documents, {text_mb:.1f} MB of text "
        f"({file_mb:.1f} MB of JSONL), {tokens:,} tokens, SentencePiece BPE vocab "
        f"{args.vocab_size}, {os.cpu_count()} cpus, median of {args.repeats}\n"
    )
    print(
        f"machine load average {load_before:.1f} before, {load_after:.1f} after (2 cores: "
        "above ~1 means other work competed for the CPUs)\n"
    )
    print(
        f"{'':<30} {'seconds':>8} {'MB/s':>7} {'docs/s':>7} {'Mtok/s':>7} {'vs raw':>7} "
        f"{'CPU s':>7} {'CPU vs raw':>10}"
    )
    results = []
    for name, seconds, cpu_seconds in rows:
        entry = {
            "name": name,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "mb_per_s": text_mb / seconds,
            "docs_per_s": len(texts) / seconds,
            "mtokens_per_s": tokens / seconds / 1e6,
            "ratio_to_raw": raw / seconds,
            "cpu_ratio_to_raw": cpu_seconds / raw_cpu,
        }
        results.append(entry)
        print(
            f"{name:<30} {seconds:>8.2f} {entry['mb_per_s']:>7.2f} {entry['docs_per_s']:>7.0f} "
            f"{entry['mtokens_per_s']:>7.2f} {entry['ratio_to_raw']:>7.2f} {cpu_seconds:>7.2f} "
            f"{entry['cpu_ratio_to_raw']:>10.2f}"
        )
    report = {
        "benchmark": "preprocess",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "documents": len(texts),
        "text_mb": text_mb,
        "tokens": tokens,
        "load_average": [load_before, load_after],
        "results": results,
    }
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
