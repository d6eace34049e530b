"""Triton LayerNorm and RMSNorm, forward and backward, fp32 statistics whatever the dtype.

A row of any width: one block of next_power_of_2(width) up to MAX_BLOCK columns, a loop over
blocks of MAX_BLOCK beyond. The forward keeps x and, per row, fp32 mean (LayerNorm) and 1/std.
The backward runs one program per run of rows: dx row by row, and that run's fp32 sums of
dy * xhat (and dy) for the weight (and bias) gradients in its own row of a partial buffer,
which torch then sums over programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # widest row handled as one block; wider rows loop over blocks of this size


def _options(width: int, block_size: int | None) -> dict:
    block = block_size or min(triton.next_power_of_2(max(width, 1)), MAX_BLOCK)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8 if block <= 4096 else 16}


def _backward_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        cap = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = 4  # the interpreter runs programs one after another: fewer is no slower
    return max(1, min(rows, cap))


class Norm(torch.autograd.Function):
    """apply(x, weight, bias | None, eps, rms, block_size | None) -> y, x's shape and dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, block_size):
        width = x.shape[-1]
        x2 = x.reshape(-1, width)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        options = _options(width, block_size)
        y = torch.empty((rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        mean = rstd if rms else torch.empty_like(rstd)  # RMSNorm keeps one statistic
        if rows > 0:
            _norm_forward[(rows,)](
                x2, weight, bias if bias is not None else weight, y, mean, rstd,
                width, x2.stride(0), y.stride(0), eps,
                RMS=rms, HAS_BIAS=bias is not None, **options,
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.rms, ctx.options, ctx.shape = rms, options, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        rows, width = x2.shape
        dy = grad_y.reshape(rows, width)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty_like(x2)
        programs = _backward_programs(rows, x2.device)
        partial_w = torch.zeros((programs, width), dtype=torch.float32, device=x2.device)
        partial_b = torch.zeros_like(partial_w) if bias is not None else partial_w
        if rows > 0:
            _norm_backward[(programs,)](
                x2, dy, weight, mean, rstd, dx, partial_w, partial_b,
                rows, width, x2.stride(0), dy.stride(0), dx.stride(0),
                triton.cdiv(rows, programs),
                RMS=ctx.rms, HAS_BIAS=bias is not None,
                ONE_BLOCK=width <= ctx.options["BLOCK"], **ctx.options,
            )  # fmt: skip
        grad_w = partial_w.sum(0).to(weight.dtype)
        grad_b = partial_b.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(ctx.shape), grad_w, grad_b, None, None, None


@triton.jit
def _norm_forward(
    X, W, B, Y, MEAN, RSTD, width, stride_x, stride_y, eps,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row: the statistics (two passes: mean, then centred squares), then y."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    mean = 0.0
    if not RMS:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            acc += tl.load(x_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
        centred = tl.where(inside, x - mean, 0.0)
        acc += centred * centred
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / width + eps)
    if not RMS:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w
        if HAS_BIAS:
            y += tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _norm_backward(
    X, DY, W, MEAN, RSTD, DX, PARTIAL_W, PARTIAL_B,
    rows, width, stride_x, stride_dy, stride_dx, rows_per_program,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per run of rows. dx = rstd (w dy - xhat mean(w dy xhat) - mean(w dy)), the
    last term LayerNorm's only. The run's sums of dy xhat (and dy) stay in registers when a row
    is one block, else are read-modify-written in this program's own partial row."""
    program = tl.program_id(0).to(tl.int64)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    partial_w = PARTIAL_W + program * width
    partial_b = PARTIAL_B + program * width
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(first, last):
        x_row = X + row * stride_x
        dy_row = DY + row * stride_dy
        rstd = tl.load(RSTD + row)
        mean = 0.0
        if not RMS:
            mean = tl.load(MEAN + row)
        sum_xhat = tl.zeros([BLOCK], dtype=tl.float32)
        sum_wdy = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
            xhat = tl.where(inside, (x - mean) * rstd, 0.0)
            sum_xhat += w * dy * xhat
            sum_wdy += w * dy
        c_xhat = tl.sum(sum_xhat, axis=0) / width
        c_mean = tl.sum(sum_wdy, axis=0) / width
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
            xhat = tl.where(inside, (x - mean) * rstd, 0.0)
            dx = w * dy - xhat * c_xhat
            if not RMS:
                dx -= c_mean
            tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=inside)
            if ONE_BLOCK:
                acc_w += dy * xhat
                acc_b += dy
            else:
                old = tl.load(partial_w + cols, mask=inside, other=0.0)
                tl.store(partial_w + cols, old + dy * xhat, mask=inside)
                if HAS_BIAS:
                    old = tl.load(partial_b + cols, mask=inside, other=0.0)
                    tl.store(partial_b + cols, old + dy, mask=inside)
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        tl.store(partial_w + cols, acc_w, mask=cols < width)
        if HAS_BIAS:
            tl.store(partial_b + cols, acc_b, mask=cols < width)
