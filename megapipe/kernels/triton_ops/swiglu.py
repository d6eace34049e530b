"""Triton SwiGLU: out = silu(gate) * up, with fc1's output h = [gate; up] on the last dim.

h is [rows, 2f] (plus an optional bias [2f] added first); out is [rows, f]. Only h (and the
bias) is saved. Backward, with s = sigmoid(gate):
    d gate = g * up * s * (1 + gate * (1 - s)),   d up = g * silu(gate),
written into one [rows, 2f] gradient, and d bias from fp32 per-row-tile column sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.kernels.triton_ops.activations import sigmoid_pair
from megapipe.kernels.triton_ops.tiling import as_rows, grid, tile


@triton.jit
def _load_halves(h_ptr, b_ptr, rows, f, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (r[:, None] < rows) & (c[None, :] < f)
    gate_offsets = r[:, None] * (2 * f) + c[None, :]
    gate = tl.load(h_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + gate_offsets + f, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate += tl.load(b_ptr + c, mask=c < f, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + f + c, mask=c < f, other=0.0).to(tl.float32)[None, :]
    return gate, up, r, c, mask, gate_offsets


@triton.jit
def _forward(
    h_ptr,
    b_ptr,
    out_ptr,
    rows,
    f,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    gate, up, r, c, mask, _ = _load_halves(h_ptr, b_ptr, rows, f, HAS_BIAS, BM, BN)
    s, _ = sigmoid_pair(gate)
    out = gate * s * up
    tl.store(out_ptr + r[:, None] * f + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    g_ptr,
    h_ptr,
    b_ptr,
    dh_ptr,
    partial_ptr,
    rows,
    f,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    gate, up, r, c, mask, gate_offsets = _load_halves(h_ptr, b_ptr, rows, f, HAS_BIAS, BM, BN)
    g = tl.load(g_ptr + r[:, None] * f + c[None, :], mask=mask, other=0.0).to(tl.float32)
    s, s_minus = sigmoid_pair(gate)
    d_gate = g * up * s * (1.0 + gate * s_minus)
    d_up = g * gate * s
    tl.store(dh_ptr + gate_offsets, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + gate_offsets + f, d_up.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        partials = partial_ptr + tl.program_id(0).to(tl.int64) * (2 * f)
        tl.store(partials + c, tl.sum(d_gate, axis=0), mask=c < f)
        tl.store(partials + f + c, tl.sum(d_up, axis=0), mask=c < f)


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up of h = [gate; up] (last dim 2f), bias [2f] or None added first."""

    @staticmethod
    def forward(ctx, h, bias, block):
        f = h.shape[-1] // 2
        h2 = as_rows(h, 2 * f)
        bias = bias.contiguous() if bias is not None else None
        tiles = tile(f, block)
        out = torch.empty((h2.shape[0], f), dtype=h.dtype, device=h.device)
        _forward[grid(h2.shape[0], f, tiles)](
            h2,
            bias if bias is not None else h2,  # a placeholder when absent: never read
            out,
            h2.shape[0],
            f,
            HAS_BIAS=bias is not None,
            BM=tiles[0],
            BN=tiles[1],
        )
        ctx.save_for_backward(h2, bias)
        ctx.tiles, ctx.shape = tiles, h.shape
        return out.view(*h.shape[:-1], f)

    @staticmethod
    def backward(ctx, grad):
        h2, bias = ctx.saved_tensors
        rows, f = h2.shape[0], h2.shape[1] // 2
        g = as_rows(grad, f)
        dh = torch.empty_like(h2)
        partials = dh  # a placeholder, never written, when there is no bias
        if bias is not None:
            row_tiles = grid(rows, f, ctx.tiles)[0]
            partials = torch.empty((row_tiles, 2 * f), dtype=torch.float32, device=h2.device)
        _backward[grid(rows, f, ctx.tiles)](
            g,
            h2,
            bias if bias is not None else h2,
            dh,
            partials,
            rows,
            f,
            HAS_BIAS=bias is not None,
            BM=ctx.tiles[0],
            BN=ctx.tiles[1],
        )
        want_bias = bias is not None and ctx.needs_input_grad[1]
        db = partials.sum(dim=0).to(bias.dtype) if want_bias else None
        return dh.view(ctx.shape), db, None
