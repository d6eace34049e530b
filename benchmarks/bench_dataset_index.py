"""Time to build a GPT dataset's indices for a synthetic dataset of 10^8 tokens.

Writes an .idx for `--tokens` tokens in documents of random (log-normal) lengths, with a sparse
.bin of the matching size, then times, each the median of --repeats runs:

- opening and validating the IndexedDataset (header, sizes, every length/pointer/boundary);
- the three indices (document, sample, shuffle) with megapipe's vectorised numpy, for
  --seq-length and --epochs epochs, next to the same sample index built by a pure-Python
  transcription of megatron.core's C++ loop (what one would write without numpy or C++);
- saving them to the .npy cache and loading them back (memory-mapped);
- blending indices for --blend-samples samples over two datasets (Megatron's greedy order).

    python benchmarks/bench_dataset_index.py            # 10^8 tokens, ~2 min on 2 cores
    python benchmarks/bench_dataset_index.py --quick    # 10^6 tokens, a few seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from megapipe.atomic_files import write_json
from megapipe.data.blending import blending_indices
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.gpt_index import build_gpt_indices, build_sample_index
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.indexed_format import IndexHeader

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "dataset_index.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=float, default=1e8)
    p.add_argument("--mean-doc", type=float, default=1000.0, help="mean document length")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=float, default=3.0, help="samples to build, in epochs")
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--blend-datasets", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-python", action="store_true", help="skip the pure-Python reference")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.blend_samples, args.repeats = 1e6, 20_000, 1
    return args


def write_synthetic(prefix: str, tokens: int, mean_doc: float, seed: int = 0) -> np.ndarray:
    """An .idx of documents totalling `tokens` uint16 tokens, and a sparse .bin to match."""
    rng = np.random.default_rng(seed)
    count = int(2 * tokens / mean_doc)
    lengths = np.maximum(1, rng.lognormal(np.log(mean_doc) - 0.5, 1.0, size=count)).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    lengths[-1] -= int(lengths.sum()) - tokens
    lengths = lengths[lengths > 0].astype(np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(prefix + ".idx", "wb") as file:
        file.write(IndexHeader(8, len(lengths), len(lengths) + 1).pack())
        file.write(lengths.tobytes())
        file.write(pointers.tobytes())
        file.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as file:
        file.truncate(int(lengths.sum()) * 2)  # sparse: only sizes matter here
    return lengths


def python_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> list:
    """megatron.core's build_sample_idx loop, in plain Python."""
    sizes, document_index = sizes.tolist(), document_index.tolist()
    num_samples = (sum(sizes[d] for d in document_index) - 1) // seq_length
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[document_index[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        rows.append((position, offset))
    return rows


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="megapipe-bench-") as work:
        prefix = os.path.join(work, "synthetic")
        tokens = int(args.tokens)
        lengths = write_synthetic(prefix, tokens, args.mean_doc)
        seconds, indexed = timed(lambda: IndexedDataset(prefix), args.repeats)
        rows.append(("open + validate IndexedDataset", seconds, ""))
        documents = np.arange(len(indexed), dtype=np.int32)
        num_samples = int(args.epochs * (tokens - 1) // args.seq_length)
        seconds, indices = timed(
            lambda: build_gpt_indices(
                indexed.sequence_lengths, documents, num_samples, args.seq_length, 1234
            ),
            args.repeats,
        )
        rows.append(("document + sample + shuffle index", seconds, ""))
        doc_index = indices.document_index
        numpy_s, sample_index = timed(
            lambda: build_sample_index(indexed.sequence_lengths, doc_index, args.seq_length),
            args.repeats,
        )
        python_note = ""
        if not args.no_python:
            python_s, reference = timed(
                lambda: python_sample_index(lengths, doc_index, args.seq_length), 1
            )
            assert np.array_equal(np.asarray(reference), sample_index), "sample index mismatch"
            python_note = f"pure Python loop {python_s:.2f} s: {python_s / numpy_s:.0f}x slower"
        rows.append(("  of which sample index (numpy)", numpy_s, python_note))
        cache = os.path.join(work, "cache")
        build = lambda: GPTDataset(
            indexed, (0, len(indexed)), num_samples, args.seq_length, 1234, cache_dir=cache
        )
        cold = time.perf_counter()
        build()
        cold = time.perf_counter() - cold
        rows.append(("GPTDataset, cache miss (build + save)", cold, ""))
        seconds, _ = timed(build, args.repeats)
        rows.append(("GPTDataset, cache hit (mmap load)", seconds, ""))
        weights = np.random.default_rng(0).random(args.blend_datasets)
        weights = list(weights / weights.sum())
        seconds, _ = timed(lambda: blending_indices(weights, args.blend_samples), 1)
        per_sample = f"{seconds / args.blend_samples * 1e9:.0f} ns/sample (Python loop)"
        name = f"blending, {args.blend_samples:,} x {args.blend_datasets} datasets"
        rows.append((name, seconds, per_sample))

    print(
        f"dataset index benchmark: {tokens:,} tokens in {len(lengths):,} documents "
        f"(mean {tokens / len(lengths):.0f}), seq {args.seq_length}, {num_samples:,} samples "
        f"({args.epochs:g} epochs), {os.cpu_count()} cpus, median of {args.repeats}\n"
    )
    print(f"{'step':<40} {'seconds':>8}  notes")
    for name, seconds, note in rows:
        print(f"{name:<40} {seconds:>8.3f}  {note}")
    report = {
        "benchmark": "dataset_index",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "documents": len(lengths),
        "samples": num_samples,
        "results": [{"step": n, "seconds": s, "note": note} for n, s, note in rows],
    }
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
