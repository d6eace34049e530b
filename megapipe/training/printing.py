"""Which rank prints: Megatron's print_rank_0 and print_rank_last, with the state passed in,
both through `megapipe.console.print_line` (one write per line)."""

from __future__ import annotations

from megapipe.console import print_line
from megapipe.parallel.state import ParallelState


def print_rank_0(state: ParallelState, message: str) -> None:
    """Print once per job, from global rank 0 (start-up information)."""
    if state.rank == 0:
        print_line(message)


def print_rank_last(state: ParallelState, message: str) -> None:
    """Print once per job, from the last global rank: it holds the last pipeline stage's loss."""
    if state.rank == state.world_size - 1:
        print_line(message)
