"""Triton bias + dropout + residual add: out = residual + keep * scale * (x + bias).

The keep-mask is an input (megapipe's masks are layout-invariant, model/dropout.py), read as
uint8. Nothing but the mask is saved for backward: d residual = g, d x = g * keep * scale, and
d bias = the column sums of d x, accumulated in fp32 per row tile. Without a mask the op is
residual + x + bias and its backward needs no kernel (d x = g, d bias = g summed in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapipe.kernels.triton_ops.tiling import as_rows, grid, tile


@triton.jit
def _tile(rows, cols, BM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    return r[:, None] * cols + c[None, :], (r[:, None] < rows) & (c[None, :] < cols), c


@triton.jit
def _forward(
    x_ptr,
    b_ptr,
    r_ptr,
    keep_ptr,
    out_ptr,
    scale,
    rows,
    cols,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    offsets, mask, c = _tile(rows, cols, BM, BN)
    v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    if HAS_MASK:
        keep = tl.load(keep_ptr + offsets, mask=mask, other=0)
        v = tl.where(keep != 0, v * scale, 0.0)
    out = tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + v
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    g_ptr,
    keep_ptr,
    dx_ptr,
    partial_ptr,
    scale,
    rows,
    cols,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    offsets, mask, c = _tile(rows, cols, BM, BN)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    keep = tl.load(keep_ptr + offsets, mask=mask, other=0)
    dx = tl.where(keep != 0, g * scale, 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(
            partial_ptr + tl.program_id(0).to(tl.int64) * cols + c,
            tl.sum(dx, axis=0),
            mask=c < cols,
        )


class BiasDropoutAdd(torch.autograd.Function):
    """residual + keep * scale * (x + bias); keep None: residual + x + bias."""

    @staticmethod
    def forward(ctx, x, bias, residual, keep, scale, block):
        cols = x.shape[-1]
        x2, r2 = as_rows(x, cols), as_rows(residual, cols)
        bias = bias.contiguous() if bias is not None else None
        keep2 = as_rows(keep, cols).view(torch.uint8) if keep is not None else None
        tiles = tile(cols, block)
        out_dtype = torch.promote_types(x.dtype, residual.dtype)  # as residual + x gives
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        _forward[grid(x2.shape[0], cols, tiles)](
            x2,
            bias if bias is not None else x2,  # placeholders when absent: never read
            r2,
            keep2 if keep2 is not None else x2,
            out,
            float(scale),
            x2.shape[0],
            cols,
            HAS_BIAS=bias is not None,
            HAS_MASK=keep is not None,
            BM=tiles[0],
            BN=tiles[1],
        )
        ctx.save_for_backward(keep2)
        ctx.scale, ctx.tiles, ctx.shape = float(scale), tiles, x.shape
        ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (keep2,) = ctx.saved_tensors
        cols = ctx.shape[-1]
        g = as_rows(grad, cols)
        has_bias = ctx.bias_dtype is not None
        want_bias = has_bias and ctx.needs_input_grad[1]
        if keep2 is None:
            dx = g.to(ctx.x_dtype)
            db = g.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype) if want_bias else None
        else:
            dx = torch.empty(g.shape, dtype=ctx.x_dtype, device=g.device)
            partials = dx  # a placeholder, never written, when there is no bias
            if has_bias:
                row_tiles = grid(g.shape[0], cols, ctx.tiles)[0]
                partials = torch.empty((row_tiles, cols), dtype=torch.float32, device=g.device)
            _backward[grid(g.shape[0], cols, ctx.tiles)](
                g,
                keep2,
                dx,
                partials,
                ctx.scale,
                g.shape[0],
                cols,
                HAS_BIAS=has_bias,
                BM=ctx.tiles[0],
                BN=ctx.tiles[1],
            )
            db = partials.sum(dim=0).to(ctx.bias_dtype) if want_bias else None
        return dx.view(ctx.shape), db, grad.to(ctx.r_dtype), None, None, None
