"""The .bin/.idx writer and reader: byte-compatible with Megatron's format as DESIGN.md states
it (checked against bytes built independently with `struct`), and every malformed file is a
one-line error naming the file and what is wrong."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megapipe.data.errors import DataError, IndexedDatasetError
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.indexed_format import token_dtype
from megapipe.data.merge import merge_datasets, prefixes_in

# (documents, each a list of sequences) used throughout; the second has two sequences.
DOCS = [[[5, 6, 7]], [[1], [2, 3, 4, 65535]], [[9, 8]], [[0, 0, 0, 0, 0]]]


def struct_idx(code: int, lengths: list[int], itemsize: int, doc_ends: list[int]) -> bytes:
    """An .idx built by hand from DESIGN.md's description, independent of megapipe's writer."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_ends) + 1)
    out += b"".join(struct.pack("<i", n) for n in lengths)
    pointer = 0
    for n in lengths:
        out += struct.pack("<q", pointer)
        pointer += n * itemsize
    out += struct.pack("<q", 0) + b"".join(struct.pack("<q", e) for e in doc_ends)
    return out


def write_docs(prefix: Path, dtype, docs=DOCS) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            if len(doc) == 1:
                builder.add_item(doc[0])
                builder.end_document()
            else:
                builder.add_document([t for s in doc for t in s], [len(s) for s in doc])


def expected_bytes(dtype_format: str, code: int, itemsize: int) -> tuple[bytes, bytes]:
    lengths = [len(s) for d in DOCS for s in d]
    ends, count = [], 0
    for d in DOCS:
        count += len(d)
        ends.append(count)
    tokens = [t for d in DOCS for s in d for t in s]
    return struct_idx(code, lengths, itemsize, ends), struct.pack(
        f"<{len(tokens)}{dtype_format}", *tokens
    )


@pytest.mark.parametrize(("dtype", "fmt", "code"), [(np.uint16, "H", 8), (np.int32, "i", 4)])
def test_writer_bytes_equal_the_format_built_with_struct(tmp_path: Path, dtype, fmt, code) -> None:
    write_docs(tmp_path / "d", dtype)
    idx, binary = expected_bytes(fmt, code, np.dtype(dtype).itemsize)
    assert (tmp_path / "d.idx").read_bytes() == idx
    assert (tmp_path / "d.bin").read_bytes() == binary
    assert len(idx) == 34 + 5 * 12 + 5 * 8  # header, 5 sequences, 4 documents + 1


def test_reader_reads_files_built_with_struct(tmp_path: Path) -> None:
    idx, binary = expected_bytes("i", 4, 4)
    (tmp_path / "m.idx").write_bytes(idx)
    (tmp_path / "m.bin").write_bytes(binary)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and len(ds) == 5 and ds.num_documents == 4
    assert [ds[i].tolist() for i in range(5)] == [s for d in DOCS for s in d]
    assert ds.document(1).tolist() == [1, 2, 3, 4, 65535]
    assert ds.get(1 + 1, offset=1, length=2).tolist() == [3, 4]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert ds.num_tokens == 15
    with pytest.raises(IndexError):
        ds.get(2, offset=3, length=2)
    with pytest.raises(IndexError):
        ds[5]
    again = pickle.loads(pickle.dumps(ds))  # reopens the memmaps in another process
    assert again[4].tolist() == [0, 0, 0, 0, 0]


def test_token_dtype_follows_megatron_vocabulary_rule() -> None:
    assert token_dtype(32000) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(None) == np.int32


def test_random_roundtrip_and_empty_sequences(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [
        [list(rng.integers(0, 50000, size=int(n))) for n in rng.integers(0, 9, size=k)]
        for k in rng.integers(1, 4, size=40)
    ]
    with IndexedDatasetBuilder(tmp_path / "r", np.int32) as builder:
        for doc in docs:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
    ds = IndexedDataset(tmp_path / "r")
    assert len(ds) == sum(len(d) for d in docs) and ds.num_documents == len(docs)
    flat = [s for d in docs for s in d]
    assert all(ds[i].tolist() == [int(t) for t in flat[i]] for i in range(len(flat)))


def test_builder_leaves_nothing_until_finalized_and_nothing_after_errors(tmp_path: Path) -> None:
    write_docs(tmp_path / "old", np.uint16)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(tmp_path / "old", np.uint16) as b:
        b.add_item([1, 2, 3])
        assert any(p.name.startswith(".old.bin.tmp") for p in tmp_path.iterdir())
        raise RuntimeError("crash mid-write")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old pair intact
    builder = IndexedDatasetBuilder(tmp_path / "new", np.uint16)
    builder.add_item([1])
    assert not (tmp_path / "new.bin").exists() and not (tmp_path / "new.idx").exists()
    builder.finalize()
    assert IndexedDataset(tmp_path / "new")[0].tolist() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "new.bin",
        "new.idx",
        "old.bin",
        "old.idx",
    ]


def test_builder_refuses_tokens_that_do_not_fit(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "x", np.uint16) as builder:
        with pytest.raises(DataError, match="token id 70000 does not fit"):
            builder.add_item([1, 70000])
        with pytest.raises(DataError, match="token id -1"):
            builder.add_item(np.array([-1]))
        builder.abort()
    assert list(tmp_path.iterdir()) == []


def test_merge_concatenates_in_order_and_checks_dtypes(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    write_docs(tmp_path / "in" / "a", np.uint16, DOCS[:2])
    write_docs(tmp_path / "in" / "b", np.uint16, DOCS[2:])
    merged = merge_datasets(prefixes_in(str(tmp_path / "in")), str(tmp_path / "m"))
    write_docs(tmp_path / "whole", np.uint16)
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "whole.idx").read_bytes()
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    assert merged.num_documents == 4
    write_docs(tmp_path / "wide", np.int32)
    with pytest.raises(DataError, match="dtype int32 differs"):
        merge_datasets([str(tmp_path / "m"), str(tmp_path / "wide")], str(tmp_path / "bad"))
    assert not (tmp_path / "bad.idx").exists() and not (tmp_path / "bad.bin").exists()
    with pytest.raises(DataError, match="also an input"):
        merge_datasets([str(tmp_path / "m")], str(tmp_path / "m"))
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="no .idx/.bin pairs"):
        prefixes_in(str(tmp_path / "none"))
    with pytest.raises(DataError, match="no such directory"):
        prefixes_in(str(tmp_path / "missing"))


# --- malformed files ------------------------------------------------------------------------


def _valid(tmp_path: Path) -> tuple[Path, bytearray, bytes]:
    write_docs(tmp_path / "v", np.uint16)
    return (
        tmp_path / "v",
        bytearray((tmp_path / "v.idx").read_bytes()),
        (tmp_path / "v.bin").read_bytes(),
    )


def _error(prefix: Path, idx: bytes | None = None, binary: bytes | None = None) -> str:
    if idx is not None:
        Path(f"{prefix}.idx").write_bytes(idx)
    if binary is not None:
        Path(f"{prefix}.bin").write_bytes(binary)
    with pytest.raises(IndexedDatasetError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert "\n" not in message
    return message


def _patch(data: bytearray, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_each_malformed_idx_is_named(tmp_path: Path) -> None:
    prefix, idx, binary = _valid(tmp_path)
    idx_name = f"{prefix}.idx"
    cases = [
        (b"MMIDIDX", "truncated header: 7 bytes"),
        (b"NOTMEGAT\x00" + bytes(idx[9:]), "not a Megatron .idx file: magic"),
        (_patch(idx, 9, "<Q", 2), "unsupported .idx version 2 at offset 9"),
        (_patch(idx, 17, "<B", 9), "unknown dtype code 9 at offset 17"),
        (_patch(idx, 17, "<B", 0), "unknown dtype code 0"),
        (
            bytes(idx[:-3]),
            "size mismatch: the header says 5 sequences and 5 document entries, "
            "which take 134 bytes; truncated: 131 bytes",
        ),
        (bytes(idx) + b"\x00" * 8, "8 bytes of trailing data"),
        (bytes(idx) + b"\x00" * 5, "multimodal"),
        (_patch(idx, 18, "<Q", 10**12), "size mismatch"),
        (_patch(idx, 26, "<Q", 0), "document count 0 at offset 26"),
        (_patch(idx, 34 + 4, "<i", -2), "sequence 1 has negative length -2 at offset 38"),
        (_patch(idx, 34 + 60, "<q", 1), "document_indices starts with 1"),
        (_patch(idx, len(idx) - 8, "<q", 4), "document_indices ends with 4"),
        (_patch(idx, 34 + 60 + 16, "<q", 0), "document_indices decreases at entry 2"),
        (_patch(idx, 34 + 20 + 8, "<q", 3), "sequence 1 has pointer 3"),
        (_patch(idx, 34 + 20 + 8, "<q", 10**9), "sequence 1 has pointer 1000000000"),
    ]
    for data, fragment in cases:
        message = _error(prefix, idx=data, binary=binary)
        assert idx_name in message, message
        assert fragment in message, (fragment, message)


def test_bin_problems_and_missing_files_are_named(tmp_path: Path) -> None:
    prefix, idx, binary = _valid(tmp_path)
    bin_name = f"{prefix}.bin"
    message = _error(prefix, bytes(idx), binary[:-2])
    assert (
        message.startswith(f"{bin_name}: truncated: sequence 4 ends at byte 30") and "28" in message
    )
    assert _error(prefix, bytes(idx), binary + b"\x00\x00") == (
        f"{bin_name}: size mismatch: 32 bytes, but {prefix}.idx describes 30"
    )
    os.unlink(bin_name)
    assert _error(prefix) == f"{bin_name}: no such file (the .bin beside {prefix}.idx)"
    assert "no such file" in _error(tmp_path / "nothing")
    (tmp_path / "empty.idx").write_bytes(b"")
    assert "truncated header: 0 bytes" in _error(tmp_path / "empty")


def test_empty_dataset_is_valid(tmp_path: Path) -> None:
    IndexedDatasetBuilder(tmp_path / "e", np.uint16).finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    assert (tmp_path / "e.idx").read_bytes() == struct_idx(8, [], 2, [])
