"""Read Megatron's .bin/.idx pairs through numpy memmaps, refusing files that do not add up.

Every check names the file and what is wrong, with the byte offset where it helps: a wrong magic,
version or dtype code, an .idx whose size disagrees with its header, lengths, pointers or
document boundaries out of range, a .bin shorter or longer than the .idx describes. A file that
passes can be read anywhere without an out-of-bounds access.
"""

from __future__ import annotations

import os

import numpy as np

from megapipe.data.errors import IndexedDatasetError
from megapipe.data.indexed_format import (
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    IndexHeader,
    bin_path,
    idx_path,
    index_file_size,
)


def _file_size(path: str, what: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise IndexedDatasetError(f"{path}: no such file ({what})") from None
    except OSError as error:
        raise IndexedDatasetError(f"{path}: cannot read ({what}): {error.strerror}") from None


def read_header(path: str) -> IndexHeader:
    """Parse and check an .idx header and the file size it implies (no arrays are read)."""
    size = _file_size(path, "the .idx of an indexed dataset")
    if size < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{path}: truncated header: {size} bytes, a Megatron .idx header has {HEADER_SIZE}"
        )
    with open(path, "rb") as file:
        magic, header = IndexHeader.unpack(file.read(HEADER_SIZE))
    if magic != MAGIC:
        raise IndexedDatasetError(
            f"{path}: not a Megatron .idx file: magic {magic!r} at offset 0, expected {MAGIC!r}"
        )
    if header.version != VERSION:
        raise IndexedDatasetError(
            f"{path}: unsupported .idx version {header.version} at offset 9 (only {VERSION})"
        )
    if header.dtype_code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{path}: unknown dtype code {header.dtype_code} at offset 17 (valid: 1-8)"
        )
    if header.document_count == 0:
        raise IndexedDatasetError(
            f"{path}: document count 0 at offset 26 (document_indices holds at least a 0)"
        )
    expected = index_file_size(header.sequence_count, header.document_count)
    if size != expected:
        counts = f"{header.sequence_count} sequences and {header.document_count} document entries"
        if size == expected + header.sequence_count:
            detail = "it has per-sequence modes (a multimodal .idx), which are not supported"
        elif size < expected:
            detail = f"truncated: {size} bytes"
        else:
            detail = f"{size - expected} bytes of trailing data"
        raise IndexedDatasetError(
            f"{path}: size mismatch: the header says {counts}, which take {expected} bytes; "
            f"{detail}"
        )
    return header


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class IndexedDataset:
    """A read-only Megatron indexed dataset: sequences (and documents) of token ids.

    `ds[i]` is sequence i as a read-only numpy view of the .bin; `ds.document(j)` concatenates
    the sequences of document j. `sequence_lengths`, `sequence_pointers` and `document_indices`
    are the .idx arrays, memory-mapped.
    """

    def __init__(self, path_prefix: str | os.PathLike) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.idx_path = idx_path(self.path_prefix)
        self.bin_path = bin_path(self.path_prefix)
        header = read_header(self.idx_path)
        self.dtype = header.dtype
        sequences, documents = header.sequence_count, header.document_count
        self._idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, sequences, HEADER_SIZE)
        pointers_at = HEADER_SIZE + 4 * sequences
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, sequences, pointers_at)
        documents_at = pointers_at + 8 * sequences
        self.document_indices = np.frombuffer(self._idx, np.int64, documents, documents_at)
        self._check_arrays(pointers_at, documents_at)
        bin_size = self._check_bin()
        if bin_size == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def _check_arrays(self, pointers_at: int, documents_at: int) -> None:
        path, lengths, docs = self.idx_path, self.sequence_lengths, self.document_indices
        if len(lengths) and (bad := lengths < 0).any():
            i = _first(bad)
            at = HEADER_SIZE + 4 * i
            raise IndexedDatasetError(
                f"{path}: sequence {i} has negative length {lengths[i]} at offset {at}"
            )
        if docs[0] != 0:
            raise IndexedDatasetError(
                f"{path}: document_indices starts with {docs[0]} at offset {documents_at}, not 0"
            )
        if docs[-1] != len(lengths):
            raise IndexedDatasetError(
                f"{path}: document_indices ends with {docs[-1]} at offset "
                f"{documents_at + 8 * (len(docs) - 1)}, not the sequence count {len(lengths)}"
            )
        if len(docs) > 1 and (bad := np.diff(docs) < 0).any():
            i = _first(bad) + 1
            raise IndexedDatasetError(
                f"{path}: document_indices decreases at entry {i} (offset {documents_at + 8 * i})"
            )

    def _check_bin(self) -> int:
        """Check the pointers against the .bin's size; return that size."""
        size = _file_size(self.bin_path, f"the .bin beside {self.idx_path}")
        pointers, itemsize = self.sequence_pointers, self.dtype.itemsize
        if len(pointers) == 0:
            needed = 0
        else:
            bad = (pointers < 0) | (pointers > size) | (pointers % itemsize != 0)
            if bad.any():
                i = _first(bad)
                raise IndexedDatasetError(
                    f"{self.idx_path}: sequence {i} has pointer {pointers[i]}, outside the "
                    f"{size}-byte {self.bin_path} or not a multiple of {itemsize}"
                )
            ends = pointers + self.sequence_lengths.astype(np.int64) * itemsize
            needed = int(ends.max())
            if needed > size:
                i = _first(ends > size)
                raise IndexedDatasetError(
                    f"{self.bin_path}: truncated: sequence {i} ends at byte {ends[i]} but the "
                    f"file has {size} bytes"
                )
        if size != needed:
            raise IndexedDatasetError(
                f"{self.bin_path}: size mismatch: {size} bytes, but {self.idx_path} describes "
                f"{needed}"
            )
        return size

    # --- reading ------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of sequences (documents, unless sentences were split)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range 0..{len(self) - 1}")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {index} "
                f"of length {size}"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, index: int) -> np.ndarray:
        """All tokens of document `index` (its sequences concatenated)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range 0..{self.num_documents - 1}")
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        parts = [self.get(i) for i in range(first, last)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}  # memmaps are reopened, not pickled

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, {len(self)} sequences, "
            f"{self.num_documents} documents, {self.dtype})"
        )
