"""Lines that several processes print to one shared stream (torchrun's ranks) arrive whole."""

from __future__ import annotations

import sys
from typing import TextIO


def print_line(message: str, file: TextIO | None = None) -> None:
    """Print `message` and its newline in ONE write, then flush.

    torchrun's ranks share one stdout. `print` writes the text and the newline separately,
    and unbuffered (PYTHONUNBUFFERED=1, as on CI) each is its own write, so another rank's
    line can land between them (CI once lost rank 1's parameter-count line, printed while
    rank 0 printed its start-up lines: most likely so). One write of a line shorter than
    PIPE_BUF (4096 bytes) reaches a pipe whole.
    """
    stream = sys.stdout if file is None else file
    if stream is not sys.stdout:
        sys.stdout.flush()  # what this process printed before comes first
    stream.write(message + "\n")
    stream.flush()


def say(message: str) -> None:
    """A line to stderr, whole (sys.stderr as it is at the call: tests may capture it)."""
    print_line(message, sys.stderr)
