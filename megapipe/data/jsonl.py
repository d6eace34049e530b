"""Read input lines in bounded chunks and turn each into texts, or into an InputIssue.

Lines are read as bytes and decoded here, so one bad byte costs one line, not the file. A line
longer than `max_line_bytes` (a file without newlines, a runaway record) is never held whole: it
is read past in bounded pieces and becomes a "line too long" issue. The 1 GiB default also keeps
every document's token count (at most one token per byte, plus the eod) inside the .idx's int32
sequence lengths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megapipe.data.errors import DataError
from megapipe.data.input_issues import InputIssue

BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = 1 << 30
_SKIP_PIECE = 1 << 20


@dataclass(frozen=True)
class LineChunk:
    """Consecutive raw input lines, the first being line `first_line` (1-based). A line the
    reader refused (too long) is there as its InputIssue instead of its bytes."""

    first_line: int
    lines: list[bytes | InputIssue]
    num_bytes: int


def open_input(path: str):
    """Open an input file for binary reading, or a DataError naming it."""
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not an input file")
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise DataError(f"{path}: no such input file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from None


def _skip_rest_of_line(file, read: int) -> int:
    """Read past the rest of an overlong line in bounded pieces; returns its full length."""
    while True:
        piece = file.readline(_SKIP_PIECE)
        read += len(piece)
        if not piece or piece.endswith(b"\n"):
            return read


def read_chunks(
    path: str, max_lines: int, max_bytes: int, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[LineChunk]:
    """Yield chunks of at most `max_lines` lines and about `max_bytes` bytes (one line at least).

    Memory is bounded by the chunk size and `max_line_bytes`, whatever the file holds.
    """
    with open_input(path) as file:
        lines: list[bytes | InputIssue] = []
        size, first, number = 0, 1, 0
        while line := file.readline(max_line_bytes + 1):
            number += 1
            length = len(line)
            if length > max_line_bytes and not line.endswith(b"\n"):
                length = _skip_rest_of_line(file, length)
                lines.append(
                    InputIssue(
                        number,
                        "line too long",
                        f"{length} bytes, over the limit of {max_line_bytes}",
                    )
                )
            else:
                lines.append(line)
            size += length
            if len(lines) >= max_lines or size >= max_bytes:
                yield LineChunk(first, lines, size)
                lines, size, first = [], 0, number + 1
        if lines:
            yield LineChunk(first, lines, size)


def decode_line(raw: bytes | InputIssue, line: int) -> str | InputIssue:
    """The line as text without its line ending (and without a UTF-8 BOM on line 1)."""
    if isinstance(raw, InputIssue):  # refused by the reader
        return raw
    if line == 1 and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        return InputIssue(line, "invalid UTF-8", f"byte offset {error.start} in the line")


def parse_json_line(
    raw: bytes | InputIssue, line: int, keys: Sequence[str]
) -> dict[str, str] | InputIssue:
    """The string values of `keys` in a JSON-object line, or what is wrong with the line."""
    text = decode_line(raw, line)
    if isinstance(text, InputIssue):
        return text
    if not text.strip():
        return InputIssue(line, "blank line")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return InputIssue(line, "malformed JSON", f"{error.msg} at column {error.colno}")
    except RecursionError:
        return InputIssue(line, "malformed JSON", "nested too deeply")
    if not isinstance(record, dict):
        return InputIssue(line, "not a JSON object", type(record).__name__)
    values: dict[str, str] = {}
    for key in keys:
        if key not in record:
            return InputIssue(line, "missing key", repr(key))
        value = record[key]
        if not isinstance(value, str):
            return InputIssue(line, "not a string", f"{key!r} is {type(value).__name__}")
        values[key] = value
    return values
