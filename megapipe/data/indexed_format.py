"""Megatron-LM's indexed dataset format, version 1: the facts both the reader and writer use.

`PREFIX.idx` (little-endian): magic `MMIDIDX\\x00\\x00`, version <Q = 1, dtype code <B,
sequence count <Q, document count <Q (34 bytes); then sequence_lengths int32[S],
sequence_pointers int64[S] (byte offsets into .bin) and document_indices int64[D], where
document_indices starts at 0 and ends at S (so D = documents + 1).
`PREFIX.bin`: the token arrays concatenated, no header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = HEADER.size  # 34

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
# Megatron switches to int32 below 65,536 on purpose, leaving room for added special tokens.
UINT16_VOCAB_LIMIT = 65500


def dtype_code(dtype: np.dtype | type) -> int:
    """The format's code for a numpy dtype (ValueError for dtypes the format cannot hold)."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in a Megatron indexed dataset")


def token_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's choice of token dtype: uint16 below 65,500 vocabulary entries, else int32."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def index_file_size(sequence_count: int, document_count: int) -> int:
    """The exact size in bytes of an .idx holding these counts."""
    return HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


@dataclass(frozen=True)
class IndexHeader:
    """The fixed-size start of an .idx file."""

    dtype_code: int
    sequence_count: int
    document_count: int
    version: int = VERSION

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DTYPE_CODES[self.dtype_code])

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC, self.version, self.dtype_code, self.sequence_count, self.document_count
        )

    @classmethod
    def unpack(cls, data: bytes) -> tuple[bytes, IndexHeader]:
        """Split the first HEADER_SIZE bytes into (magic, header) without judging them."""
        magic, version, code, sequences, documents = HEADER.unpack(data[:HEADER_SIZE])
        return magic, cls(code, sequences, documents, version)
