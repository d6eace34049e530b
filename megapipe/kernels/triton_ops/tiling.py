"""How the elementwise kernels cut a [rows, cols] tensor into tiles, and the grid for it."""

from __future__ import annotations

import torch
import triton

MAX_BLOCK_COLS = 256
TILE_ELEMENTS = 4096  # elements per program: enough work per program on a GPU


def tile(cols: int, block: tuple[int, int] | None = None) -> tuple[int, int]:
    """(block_rows, block_cols), powers of two; `block` overrides (tests use small blocks to
    cover the masked edges of shapes that are not multiples of the block)."""
    if block is not None:
        for size in block:
            if size < 1 or size & (size - 1):
                raise ValueError(f"block sizes must be powers of two, got {block}")
        return block
    block_cols = min(MAX_BLOCK_COLS, triton.next_power_of_2(max(cols, 1)))
    return max(1, TILE_ELEMENTS // block_cols), block_cols


def grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Programs over (row tiles, column tiles)."""
    return triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1])


def as_rows(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x as a contiguous [rows, cols] view (a copy only if x is not contiguous)."""
    return x.contiguous().view(-1, cols)
