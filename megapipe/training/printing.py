"""Which rank prints: Megatron's print_rank_0 and print_rank_last, with the state passed in,
and `print_line`, which every rank's output goes through."""

from __future__ import annotations

import sys
from typing import TextIO

from megapipe.parallel.state import ParallelState


def print_line(message: str, file: TextIO | None = None) -> None:
    """Print `message` and its newline in ONE write, then flush.

    torchrun's ranks share one stdout. `print` writes the text and the newline separately,
    and unbuffered (PYTHONUNBUFFERED=1, as on CI) each is its own write, so another rank's
    line can land between them (CI once lost rank 1's parameter-count line, printed while
    rank 0 printed its start-up lines: most likely so). One write of a line shorter than
    PIPE_BUF (4096 bytes) reaches a pipe whole.
    """
    stream = sys.stdout if file is None else file
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(state: ParallelState, message: str) -> None:
    """Print once per job, from global rank 0 (start-up information)."""
    if state.rank == 0:
        print_line(message)


def print_rank_last(state: ParallelState, message: str) -> None:
    """Print once per job, from the last global rank: it holds the last pipeline stage's loss."""
    if state.rank == state.world_size - 1:
        print_line(message)
