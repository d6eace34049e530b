"""Read input lines in bounded chunks and turn each into texts, or into an InputIssue.

Lines are read as bytes and decoded here, so one bad byte costs one line, not the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megapipe.data.errors import DataError
from megapipe.data.input_issues import InputIssue

BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class LineChunk:
    """Consecutive raw input lines, the first being line `first_line` (1-based)."""

    first_line: int
    lines: list[bytes]
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


def read_chunks(path: str, max_lines: int, max_bytes: int) -> Iterator[LineChunk]:
    """Yield chunks of at most `max_lines` lines and about `max_bytes` bytes (one line at least).

    Memory is bounded by the chunk size, whatever the file size (a single line is read whole).
    """
    with open_input(path) as file:
        lines: list[bytes] = []
        size, first = 0, 1
        for number, line in enumerate(file, 1):
            lines.append(line)
            size += len(line)
            if len(lines) >= max_lines or size >= max_bytes:
                yield LineChunk(first, lines, size)
                lines, size, first = [], 0, number + 1
        if lines:
            yield LineChunk(first, lines, size)


def decode_line(raw: bytes, line: int) -> str | InputIssue:
    """The line as text without its line ending (and without a UTF-8 BOM on line 1)."""
    if line == 1 and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        return InputIssue(line, "invalid UTF-8", f"byte offset {error.start} in the line")


def parse_json_line(raw: bytes, line: int, keys: Sequence[str]) -> dict[str, str] | InputIssue:
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
