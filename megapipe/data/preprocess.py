"""JSONL -> Megatron .bin/.idx, streamed through `workers` processes with bounded memory.

The main process reads raw lines in chunks, workers parse and tokenize them (document_encoder),
and the main process writes results in input order. At most 2 x workers chunks are in flight,
so memory does not grow with the input. Outputs are written under temporary names and renamed
only when everything succeeded; any error (or --strict and a bad line) leaves no output.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from megapipe.data.document_encoder import (
    EncodedChunk,
    EncodeSettings,
    cached_tokenizer,
    encode_chunk,
    output_prefixes,
)
from megapipe.data.errors import DataError
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_format import token_dtype
from megapipe.data.input_issues import IssueLog
from megapipe.data.jsonl import MAX_LINE_BYTES, open_input, read_chunks
from megapipe.data.progress import Progress
from megapipe.data.tokenizers import TokenizerSpec


@dataclass(frozen=True)
class PreprocessOptions:
    """Megatron's preprocess_data.py flags (plus --strict and the chunking knobs)."""

    input: str
    output_prefix: str
    tokenizer: TokenizerSpec
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    workers: int = 1
    strict: bool = False
    log_interval: int = 1000
    chunk_lines: int = 256
    chunk_bytes: int = 512 << 10
    max_line_bytes: int = MAX_LINE_BYTES  # a longer line is skipped as "line too long"


@dataclass
class PreprocessReport:
    outputs: dict[str, str]
    documents: int = 0
    lines: int = 0
    bytes: int = 0
    seconds: float = 0.0
    issues: IssueLog | None = None
    tokens: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 1e6
        names = ", ".join(f"{p}.bin/.idx" for p in self.outputs.values())
        return (
            f"wrote {self.documents} documents to {names} in {self.seconds:.2f} s "
            f"({self.documents / max(self.seconds, 1e-9):.0f} docs/s, {rate:.2f} MB/s)"
        )


def _encoded_chunks(options: PreprocessOptions, settings: EncodeSettings) -> Iterator[EncodedChunk]:
    chunks = read_chunks(
        options.input, options.chunk_lines, options.chunk_bytes, options.max_line_bytes
    )
    if options.workers <= 1:
        for chunk in chunks:
            yield encode_chunk(settings, chunk)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(options.workers) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (settings, chunk)))
            if len(pending) >= 2 * options.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(options: PreprocessOptions, *, show_progress: bool = True) -> PreprocessReport:
    """Tokenize `options.input` into Megatron indexed datasets, one per JSON key."""
    if options.workers < 1:
        raise DataError(f"--workers must be at least 1, got {options.workers}")
    if not options.json_keys:
        raise DataError("--json-keys needs at least one key")
    tokenizer = cached_tokenizer(options.tokenizer)  # fail fast, in the main process
    if options.append_eod:
        tokenizer.eod  # noqa: B018 - raises TokenizerError when there is none
    dtype = token_dtype(tokenizer.vocab_size)
    settings = EncodeSettings(
        tokenizer=options.tokenizer,
        json_keys=tuple(options.json_keys),
        dtype=dtype.name,
        append_eod=options.append_eod,
        split_sentences=options.split_sentences,
        keep_newlines=options.keep_newlines,
    )
    open_input(options.input).close()
    outputs = output_prefixes(options.output_prefix, options.json_keys, options.split_sentences)
    out_dir = os.path.dirname(os.path.abspath(options.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix {options.output_prefix}: no directory {out_dir}")

    report = PreprocessReport(outputs, issues=IssueLog(options.input, options.strict))
    progress = Progress(os.path.getsize(options.input), options.log_interval, enabled=show_progress)
    builders = {key: IndexedDatasetBuilder(prefix, dtype) for key, prefix in outputs.items()}
    start = time.perf_counter()
    try:
        for chunk in _encoded_chunks(options, settings):
            report.issues.extend(chunk.issues)
            for key, arrays in chunk.arrays.items():
                builders[key].add_documents(
                    arrays.tokens, arrays.sequence_lengths, arrays.sequences_per_document
                )
                report.tokens[key] = report.tokens.get(key, 0) + int(arrays.tokens.size)
            report.documents += chunk.num_documents
            report.lines += chunk.num_lines
            report.bytes += chunk.num_bytes
            progress.update(chunk.num_documents, chunk.num_bytes)
        if report.documents == 0:
            summary = report.issues.summary(report.lines)
            raise DataError(f"{options.input}: no usable documents; {summary}")
        for builder in builders.values():  # all .idx written before any file is renamed
            builder.prepare()
        for builder in builders.values():
            builder.publish()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        progress.close()
    report.seconds = time.perf_counter() - start
    return report
