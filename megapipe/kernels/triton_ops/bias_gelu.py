"""Triton bias + GeLU: y = gelu(x + bias), forward and backward, fp32 inside.

The forward saves x and bias, not x + bias (one activation less than the unfused ops keep);
the backward recomputes x + bias, writes d(x + bias) in x's dtype and, per row tile, the fp32
column sums that make the bias gradient.

The tanh form is computed as x * sigmoid(2z) with z = sqrt(2/pi) (x + 0.044715 x^3), which
equals 0.5 x (1 + tanh z) and keeps its relative precision where 1 + tanh z is tiny; its slope
uses 1 - sigmoid(2z) computed as such, not by subtraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.kernels.triton_ops.activations import sigmoid_pair
from megapipe.kernels.triton_ops.tiling import as_rows, grid, tile

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TANH_COEF = tl.constexpr(0.044715)


@triton.jit
def _gelu_and_slope(u, TANH: tl.constexpr):
    """(gelu(u), gelu'(u)) in fp32."""
    if TANH:
        z = _SQRT_2_OVER_PI * (u + _TANH_COEF * u * u * u)
        s, s_minus = sigmoid_pair(2.0 * z)  # sigmoid(2z) = (1 + tanh z) / 2, and 1 - that
        dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_COEF * u * u)
        y = u * s
        slope = s + 2.0 * u * s * s_minus * dz
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(u * _SQRT_HALF))
        y = u * cdf
        slope = cdf + u * _INV_SQRT_2PI * tl.exp(-0.5 * u * u)
    return y, slope


@triton.jit
def _load_input(
    x_ptr, b_ptr, rows, cols, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    offsets = r[:, None] * cols + c[None, :]
    u = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(b_ptr + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    return u, offsets, mask, c


@triton.jit
def _forward(
    x_ptr,
    b_ptr,
    y_ptr,
    rows,
    cols,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    u, offsets, mask, c = _load_input(x_ptr, b_ptr, rows, cols, HAS_BIAS, BM, BN)
    y, _ = _gelu_and_slope(u, TANH)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    g_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    partial_ptr,
    rows,
    cols,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    u, offsets, mask, c = _load_input(x_ptr, b_ptr, rows, cols, HAS_BIAS, BM, BN)
    _, slope = _gelu_and_slope(u, TANH)
    du = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * slope
    tl.store(dx_ptr + offsets, du.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:  # masked-off elements loaded g = 0, so they add nothing
        tl.store(
            partial_ptr + tl.program_id(0).to(tl.int64) * cols + c,
            tl.sum(du, axis=0),
            mask=c < cols,
        )


class BiasGeLU(torch.autograd.Function):
    """gelu(x + bias) over the last dim of x; bias [cols] or None."""

    @staticmethod
    def forward(ctx, x, bias, approximate, block):
        cols = x.shape[-1]
        x2 = as_rows(x, cols)
        bias = bias.contiguous() if bias is not None else None
        tiles = tile(cols, block)
        y = torch.empty_like(x2)
        _forward[grid(x2.shape[0], cols, tiles)](
            x2,
            bias if bias is not None else x2,  # any pointer when there is no bias: never read
            y,
            x2.shape[0],
            cols,
            HAS_BIAS=bias is not None,
            TANH=approximate == "tanh",
            BM=tiles[0],
            BN=tiles[1],
        )
        ctx.save_for_backward(x2, bias)
        ctx.tanh, ctx.tiles, ctx.shape = approximate == "tanh", tiles, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, bias = ctx.saved_tensors
        rows, cols = x2.shape
        g = as_rows(grad, cols)
        dx = torch.empty_like(x2)
        row_tiles = grid(rows, cols, ctx.tiles)[0]
        partials = dx  # a placeholder, never written, when there is no bias
        if bias is not None:
            partials = torch.empty((row_tiles, cols), dtype=torch.float32, device=x2.device)
        _backward[grid(rows, cols, ctx.tiles)](
            g,
            x2,
            bias if bias is not None else x2,
            dx,
            partials,
            rows,
            cols,
            HAS_BIAS=bias is not None,
            TANH=ctx.tanh,
            BM=ctx.tiles[0],
            BN=ctx.tiles[1],
        )
        want_bias = bias is not None and ctx.needs_input_grad[1]
        db = partials.sum(dim=0).to(bias.dtype) if want_bias else None
        return dx.view(ctx.shape), db, None, None
