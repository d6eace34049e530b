"""Write Megatron's .bin/.idx pairs: streamed to temporary names, renamed only when complete.

Tokens go to the .bin as they arrive (memory stays bounded by the per-sequence bookkeeping, 12
bytes a sequence, as in Megatron's own builder); `finalize` writes the .idx, fsyncs both and
renames them into place. Until then, and after `abort` or an exception in a `with` block, no
file with the final names exists: a crash never leaves a pair that looks valid.
"""

from __future__ import annotations

import os
import shutil
from array import array
from collections.abc import Sequence

import numpy as np

from megapipe.atomic_files import commit, discard, temp_path_for
from megapipe.data.errors import DataError
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.indexed_format import IndexHeader, bin_path, dtype_code, idx_path


class IndexedDatasetBuilder:
    """Accumulate sequences and documents into PREFIX.bin/.idx with tokens of `dtype`."""

    def __init__(self, path_prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._lengths = array("i")
        self._documents = array("q", [0])
        self._bin_temp = temp_path_for(bin_path(self.path_prefix))
        self._idx_temp = temp_path_for(idx_path(self.path_prefix))
        self._bin = open(self._bin_temp, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._done = False
        self._prepared = False
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    # --- adding data --------------------------------------------------------------------------

    def _write(self, tokens: np.ndarray | Sequence[int]) -> int:
        tokens = np.asarray(tokens)
        if tokens.size and self._range is not None and tokens.dtype != self.dtype:
            low, high = int(tokens.min()), int(tokens.max())
            if low < self._range[0] or high > self._range[1]:
                bad = low if low < self._range[0] else high
                raise DataError(
                    f"{self.path_prefix}: token id {bad} does not fit the dataset's {self.dtype} "
                    f"(range {self._range[0]}..{self._range[1]})"
                )
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        return int(tokens.size)

    def add_item(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Append one sequence (call end_document after a document's last sequence)."""
        self._lengths.append(self._write(tokens))

    def end_document(self) -> None:
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray | Sequence[int], lengths: Sequence[int]) -> None:
        """Append one document made of sequences of `lengths` tokens, stored back to back."""
        self.add_documents(tokens, np.asarray(lengths), np.asarray([len(lengths)]))

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray
    ) -> None:
        """Append many documents at once (the preprocessing fast path)."""
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64)
        total = int(sequence_lengths.sum())
        if total != np.asarray(tokens).size or int(sequences_per_document.sum()) != len(
            sequence_lengths
        ):
            raise ValueError("tokens, sequence lengths and sequences per document disagree")
        self._write(tokens)
        start = len(self._lengths)
        self._lengths.frombytes(sequence_lengths.astype(np.int32).tobytes())
        ends = start + np.cumsum(sequences_per_document)
        self._documents.frombytes(ends.astype(np.int64).tobytes())

    def add_index(self, path_prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (same dtype), copying its .bin in chunks."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{other.idx_path}: dtype {other.dtype} differs from the merged dataset's "
                f"{self.dtype}"
            )
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(np.int32).tobytes())
        self._documents.frombytes((other.document_indices[1:] + offset).tobytes())
        with open(other.bin_path, "rb") as source:
            shutil.copyfileobj(source, self._bin, 16 << 20)

    # --- finishing ----------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._documents) - 1

    def finalize(self) -> None:
        """Write the .idx and move both files into place (fsync, then rename)."""
        self.prepare()
        self.publish()

    def prepare(self) -> None:
        """Close the .bin and write the .idx, both still under temporary names."""
        if self._done or self._prepared:
            raise RuntimeError(f"{self.path_prefix}: builder already finalized or aborted")
        self._bin.close()
        if self._documents[-1] != len(self._lengths):  # close a document left open
            self._documents.append(len(self._lengths))
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        header = IndexHeader(self._code, len(lengths), len(self._documents))
        try:
            with open(self._idx_temp, "wb") as file:
                file.write(header.pack())
                file.write(lengths.tobytes())
                file.write(pointers.tobytes())
                file.write(np.frombuffer(self._documents, dtype=np.int64).tobytes())
        except BaseException:
            self.abort()
            raise
        self._prepared = True

    def publish(self) -> None:
        """Rename the prepared pair into place: the .bin first, the .idx (which makes it
        readable) last, after removing any old .idx so it never sits beside a new .bin."""
        if not self._prepared or self._done:
            raise RuntimeError(f"{self.path_prefix}: publish() needs prepare() first")
        try:
            final_idx = idx_path(self.path_prefix)
            discard(final_idx)
            commit(self._bin_temp, bin_path(self.path_prefix))
            commit(self._idx_temp, final_idx)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; the final names are left untouched."""
        if not self._bin.closed:
            self._bin.close()
        discard(self._bin_temp, self._idx_temp)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            if exc_type is None:
                self.finalize()
            else:
                self.abort()
