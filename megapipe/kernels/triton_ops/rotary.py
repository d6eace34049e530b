"""Triton rotary embedding, the non-interleaved "rotate half" form, forward and backward.

x [s, b, heads, d] is viewed as rows of d; row r is at position r // (b * heads) + offset and
reads that row of the cos/sin tables [positions, d] (fp32, read as they are). With x = [x1, x2]
and the tables' halves c = [c1, c2], s = [s1, s2]:

    forward   out = x * c + rotate_half(x) * s:  [x1 c1 - x2 s1,  x2 c2 + x1 s2]
    backward  dx = g * c + rotate_half^T(g * s): [g1 c1 + g2 s2,  g2 c2 - g1 s1]

(rotate_half [x1, x2] -> [-x2, x1] has the transpose [y1, y2] -> [y2, -y1]). Nothing but the
tables is saved; the tables get no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.kernels.triton_ops.tiling import as_rows, grid, tile


@triton.jit
def _rotate(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rows,
    half,
    rows_per_position,
    offset,
    BACKWARD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (r[:, None] < rows) & (c[None, :] < half)
    x_offsets = r[:, None] * (2 * half) + c[None, :]
    x1 = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offsets + half, mask=mask, other=0.0).to(tl.float32)
    position = r // rows_per_position + offset
    t_offsets = position[:, None] * (2 * half) + c[None, :]
    c1 = tl.load(cos_ptr + t_offsets, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t_offsets + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t_offsets, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t_offsets + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + x_offsets, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + x_offsets + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int,
    backward: bool,
    block: tuple[int, int] | None,
) -> torch.Tensor:
    """One launch: x [s, b, heads, d] rotated by (or, backward, back through) the tables."""
    d = x.shape[-1]
    x2 = as_rows(x, d)
    out = torch.empty_like(x2)
    tiles = tile(d // 2, block)
    _rotate[grid(x2.shape[0], d // 2, tiles)](
        x2,
        cos,
        sin,
        out,
        x2.shape[0],
        d // 2,
        x.shape[1] * x.shape[2],
        offset,
        BACKWARD=backward,
        BM=tiles[0],
        BN=tiles[1],
    )
    return out.view(x.shape)


class Rotary(torch.autograd.Function):
    """x [s, b, heads, d] at positions offset.. of the [positions, d] cos/sin tables."""

    @staticmethod
    def forward(ctx, x, cos, sin, offset, block):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.offset, ctx.block = offset, block
        return rotate(x, cos, sin, offset, False, block)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, sin, ctx.offset, True, ctx.block), None, None, None, None
