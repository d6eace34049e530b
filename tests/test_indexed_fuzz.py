"""Fuzz the .idx reader (hypothesis): arbitrary and mutated files either open, and then every
sequence reads within bounds (whole, in random slices, after a pickle round trip as a data
loader worker receives it), or fail with IndexedDatasetError; never another exception.
MEGAPIPE_FUZZ_EXAMPLES sets the examples per test (tests/test_fuzz.py)."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from megapipe.data.errors import IndexedDatasetError
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.indexed_format import HEADER, MAGIC
from tests.helpers import fuzz_settings

SETTINGS = fuzz_settings(150)


def _check(idx: bytes, binary: bytes, slices: list[tuple[int, int, int]] = ()) -> None:
    with tempfile.TemporaryDirectory() as directory:
        prefix = Path(directory) / "f"
        Path(f"{prefix}.idx").write_bytes(idx)
        Path(f"{prefix}.bin").write_bytes(binary)
        try:
            ds = IndexedDataset(prefix)
        except IndexedDatasetError as error:
            assert "\n" not in str(error) and str(prefix) in str(error)
            return
        total = 0
        for i in range(len(ds)):
            tokens = ds[i]
            assert len(tokens) == ds.sequence_lengths[i]
            total += len(tokens)
        for j in range(ds.num_documents):
            ds.document(j)
        assert total * ds.dtype.itemsize == len(binary)
        copy = pickle.loads(pickle.dumps(ds))
        for index, offset, length in slices:
            try:
                part = copy.get(index, offset, length)
            except IndexError:
                size = int(ds.sequence_lengths[index]) if 0 <= index < len(ds) else -1
                assert size < 0 or offset < 0 or length < 0 or offset + length > size
                continue
            assert part.tolist() == ds[index][offset : offset + length].tolist()
        del ds, copy


def _valid_pair(lengths: list[int], code_dtype) -> tuple[bytes, bytes]:
    with tempfile.TemporaryDirectory() as directory:
        prefix = Path(directory) / "v"
        with IndexedDatasetBuilder(prefix, code_dtype) as builder:
            for n in lengths:
                builder.add_item(np.arange(n) % 100)
                builder.end_document()
        return Path(f"{prefix}.idx").read_bytes(), Path(f"{prefix}.bin").read_bytes()


@SETTINGS
@given(idx=st.binary(max_size=200), binary=st.binary(max_size=64))
def test_arbitrary_bytes(idx: bytes, binary: bytes) -> None:
    _check(idx, binary)


@SETTINGS
@given(
    code=st.integers(0, 255),
    version=st.integers(0, 3),
    sequences=st.integers(0, 2**64 - 1) | st.integers(0, 6),
    documents=st.integers(0, 2**64 - 1) | st.integers(0, 7),
    body=st.binary(max_size=160),
    binary=st.binary(max_size=64),
)
def test_valid_magic_with_arbitrary_header_and_body(
    code: int, version: int, sequences: int, documents: int, body: bytes, binary: bytes
) -> None:
    _check(HEADER.pack(MAGIC, version, code, sequences, documents) + body, binary)


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    dtype=st.sampled_from([np.uint8, np.uint16, np.int32, np.int64]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(-8, 8),
    bin_cut=st.integers(-4, 4),
    slices=st.lists(
        st.tuples(st.integers(-1, 6), st.integers(-2, 7), st.integers(-2, 7)), max_size=5
    ),  # fmt: skip
)
def test_mutated_valid_files(lengths, dtype, edits, cut, bin_cut, slices) -> None:
    idx, binary = _valid_pair(lengths, dtype)
    idx = bytearray(idx)
    for position, value in edits:
        idx[position % len(idx)] = value
    idx = bytes(idx[: len(idx) + cut]) if cut < 0 else bytes(idx) + bytes(cut)
    binary = binary[: len(binary) + bin_cut] if bin_cut < 0 else binary + bytes(bin_cut)
    _check(idx, binary, slices)
