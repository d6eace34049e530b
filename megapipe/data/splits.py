"""Megatron's `--split 969,30,1`: train/valid/test shares of a dataset's sequences.

The string is normalised to fractions, turned into cumulative book-ends, and each split takes
sequences [round(start * n), round(end * n)) of the n in the dataset, as megatron.core does.
"""

from __future__ import annotations

import re

import numpy as np

from megapipe.data.errors import DataError

SPLIT_NAMES = ("train", "valid", "test")


def normalize(weights: list[float]) -> list[float]:
    """Weights divided by their sum, computed as Megatron does (numpy, float64)."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def parse_split(split: str) -> list[float]:
    """`"969, 30, 1"` -> [0.969, 0.03, 0.001]; missing parts are 0."""
    pieces = [piece.strip() for piece in re.split(r"[,/]", split)]
    if not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", piece) for piece in pieces if piece):
        raise DataError(f"--split {split!r}: only numbers separated by commas are allowed")
    parts = [float(piece) for piece in pieces if piece]
    if not parts or len(parts) > len(SPLIT_NAMES):
        raise DataError(f"--split {split!r}: expected 1 to 3 numbers, like 969,30,1")
    parts += [0.0] * (len(SPLIT_NAMES) - len(parts))
    if sum(parts) <= 0:
        raise DataError(f"--split {split!r}: the parts sum to zero")
    return normalize(parts)


def split_matrix(fractions: list[float]) -> list[tuple[float, float] | None]:
    """[0.9, 0.1, 0.0] -> [(0.0, 0.9), (0.9, 1.0), None]: each split's book-ends, or None."""
    bounds = [0.0]
    for fraction in fractions:
        bounds.append(bounds[-1] + fraction)
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def split_range(bookends: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """The [begin, end) element range of one split."""
    return int(round(bookends[0] * float(num_elements))), int(
        round(bookends[1] * float(num_elements))
    )
