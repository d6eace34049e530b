"""Concatenate several indexed datasets (same dtype) into one, streaming the .bin files."""

from __future__ import annotations

import os
from collections.abc import Sequence

from megapipe.data.errors import DataError
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_dataset import IndexedDataset


def prefixes_in(directory: str) -> list[str]:
    """The dataset prefixes in `directory` (sorted, as Megatron's merge tool orders them)."""
    if not os.path.isdir(directory):
        raise DataError(f"--input {directory}: no such directory")
    names = sorted(os.listdir(directory))
    prefixes = []
    for name in names:
        if name.endswith(".idx") and not name.startswith("."):
            stem = name[: -len(".idx")]
            if stem + ".bin" not in names:
                raise DataError(f"{os.path.join(directory, name)}: no matching .bin")
            prefixes.append(os.path.join(directory, stem))
    if not prefixes:
        raise DataError(f"--input {directory}: no .idx/.bin pairs found")
    return prefixes


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Write `output_prefix`.bin/.idx holding every dataset of `prefixes`, in order."""
    if not prefixes:
        raise DataError("nothing to merge: no input datasets")
    output = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == output for p in prefixes):
        raise DataError(f"--output-prefix {output_prefix} is also an input")
    first = IndexedDataset(prefixes[0])  # validates, and gives the dtype
    with IndexedDatasetBuilder(output_prefix, first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
    return IndexedDataset(output_prefix)
