"""Turn a chunk of JSONL lines into token arrays, one set per JSON key (runs in workers).

A line is used only if every key yields a string that tokenizes to at least one token, so the
outputs for several keys stay aligned document by document. The rest become InputIssues.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.data.errors import DataError, TokenizerError
from megapipe.data.input_issues import InputIssue
from megapipe.data.jsonl import LineChunk, parse_json_line
from megapipe.data.sentences import split_sentences
from megapipe.data.tokenizers import Tokenizer, TokenizerSpec, build_tokenizer


@dataclass(frozen=True)
class EncodeSettings:
    """Everything a worker needs; small and hashable, so it travels with each task."""

    tokenizer: TokenizerSpec
    json_keys: tuple[str, ...]
    dtype: str  # numpy dtype name of the output tokens
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False


@dataclass(frozen=True)
class KeyArrays:
    """The documents of one chunk for one key: tokens, sequence lengths, sequences per doc."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass(frozen=True)
class EncodedChunk:
    first_line: int
    num_lines: int
    num_bytes: int
    num_documents: int
    arrays: dict[str, KeyArrays]
    issues: list[InputIssue]


@functools.lru_cache(maxsize=4)
def cached_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """One tokenizer per process and spec (workers build theirs on first use)."""
    return build_tokenizer(spec)


def _tokenize_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int] | TokenizerError]:
    """Batch-tokenize; if the batch fails, redo text by text to pin the failure on its line."""
    try:
        return list(tokenizer.tokenize_batch(texts))
    except (TokenizerError, ValueError, TypeError):
        results: list[list[int] | TokenizerError] = []
        for text in texts:
            try:
                results.append(tokenizer.tokenize(text))
            except (TokenizerError, ValueError, TypeError) as error:
                results.append(TokenizerError(str(error)))
        return results


def _to_dtype(ids: list[int], total: int, dtype: np.dtype) -> np.ndarray:
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if values.size:
        info = np.iinfo(dtype)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            raise DataError(f"token id {high if high > info.max else low} does not fit {dtype}")
    return values.astype(dtype)


def encode_chunk(settings: EncodeSettings, chunk: LineChunk) -> EncodedChunk:
    """Parse, tokenize and pack one chunk; never raises for bad input, only for bad settings."""
    tokenizer = cached_tokenizer(settings.tokenizer)
    eod = tokenizer.eod if settings.append_eod else None
    issues: list[InputIssue] = []
    docs: list[tuple[int, dict[str, str]]] = []
    for offset, raw in enumerate(chunk.lines):
        parsed = parse_json_line(raw, chunk.first_line + offset, settings.json_keys)
        if isinstance(parsed, InputIssue):
            issues.append(parsed)
        else:
            docs.append((chunk.first_line + offset, parsed))

    # Per key: each document as a list of sequences (sentences, or the whole text).
    per_key: dict[str, list[list[list[int]]]] = {}
    bad: dict[int, InputIssue] = {}
    for key in settings.json_keys:
        texts = [values[key] for _, values in docs]
        if settings.split_sentences:
            pieces = [split_sentences(text, settings.keep_newlines) for text in texts]
        else:
            pieces = [[text] for text in texts]
        flat = _tokenize_all(tokenizer, [s for sentences in pieces for s in sentences])
        sequences: list[list[list[int]]] = []
        position = 0
        for (line, _), sentences in zip(docs, pieces):
            encoded = flat[position : position + len(sentences)]
            position += len(sentences)
            error = next((e for e in encoded if isinstance(e, TokenizerError)), None)
            if error is not None:
                bad.setdefault(line, InputIssue(line, "tokenizer error", f"{key!r}: {error}"))
                encoded = []
            kept = [ids for ids in encoded if len(ids) > 0]
            if not kept and line not in bad:
                bad[line] = InputIssue(line, "empty document", f"{key!r} has no tokens")
            if eod is not None and kept:
                kept[-1] = [*kept[-1], eod]
            sequences.append(kept)
        per_key[key] = sequences
    issues.extend(bad.values())

    keep = [i for i, (line, _) in enumerate(docs) if line not in bad]
    dtype = np.dtype(settings.dtype)
    arrays = {}
    for key, sequences in per_key.items():
        kept_docs = [sequences[i] for i in keep]
        flat_ids = [ids for doc in kept_docs for ids in doc]
        lengths = np.fromiter((len(ids) for ids in flat_ids), dtype=np.int64, count=len(flat_ids))
        arrays[key] = KeyArrays(
            tokens=_to_dtype(flat_ids, int(lengths.sum()), dtype),
            sequence_lengths=lengths,
            sequences_per_document=np.array([len(doc) for doc in kept_docs], dtype=np.int64),
        )
    return EncodedChunk(
        chunk.first_line, len(chunk.lines), chunk.num_bytes, len(keep), arrays, issues
    )


def output_prefixes(output_prefix: str, keys: Sequence[str], sentences: bool) -> dict[str, str]:
    """Megatron's output names: `{prefix}_{key}_document` (`_sentence` when split)."""
    level = "sentence" if sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in keys}
