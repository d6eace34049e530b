"""Triton scaled masked / causal softmax over the last dimension, forward and backward.

One program per query row. The forward streams the row twice (an online max and sum of
exponentials in fp32, then the write), so a row may be wider than one block; the mask is read
through its broadcast strides, never expanded in memory; causal needs no mask at all. The
backward reads the saved probabilities y: dx = scale * y * (dy - sum(dy * y)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # widest row handled as one block; wider rows loop over blocks of this size


def _launch_options(width: int, block_size: int | None) -> dict:
    block = block_size or min(triton.next_power_of_2(max(width, 1)), MAX_BLOCK)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8 if block <= 2048 else 16}


class MaskedSoftmax(torch.autograd.Function):
    """apply(scores [b, h, s_q, s_k], mask | None (causal), scale, block_size | None)."""

    @staticmethod
    def forward(ctx, scores, mask, scale, block_size):
        scores = scores.contiguous()
        b, heads, s_q, s_k = scores.shape
        probs = torch.empty_like(scores)
        causal = mask is None
        if causal:  # a placeholder the kernel never reads
            mask_u8, mask_strides = scores, (0, 0, 0, 0)
        else:
            expanded = mask.expand(scores.shape)
            mask_u8, mask_strides = expanded.view(torch.uint8), expanded.stride()
        options = _launch_options(s_k, block_size)
        if probs.numel() > 0:
            _softmax_forward[(b * heads * s_q,)](
                scores, mask_u8, probs, heads, s_q, s_k, *mask_strides, scale,
                CAUSAL=causal, **options,
            )  # fmt: skip
        ctx.save_for_backward(probs)
        ctx.scale, ctx.options = scale, options
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        (probs,) = ctx.saved_tensors
        grad_probs = grad_probs.contiguous()
        grad_scores = torch.empty_like(probs)
        s_k = probs.shape[-1]
        rows = probs.numel() // s_k if s_k else 0
        if rows > 0:
            _softmax_backward[(rows,)](
                probs, grad_probs, grad_scores, s_k, ctx.scale, **ctx.options
            )
        return grad_scores, None, None, None


@triton.jit
def _softmax_forward(
    S, MASK, P, heads, s_q, s_k, mask_sb, mask_sh, mask_sq, mask_sk, scale,
    CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per query row: an online max and sum over key blocks, then the write."""
    row = tl.program_id(0).to(tl.int64)
    query = row % s_q
    head = (row // s_q) % heads
    batch = row // (s_q * heads)
    s_row = S + row * s_k
    p_row = P + row * s_k
    m_row = MASK + batch * mask_sb + head * mask_sh + query * mask_sq
    last_key = query + s_k - s_q  # causal: the last key this query may attend
    row_max = float("-inf")
    total = 0.0
    for start in range(0, s_k, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        allowed = keys < s_k
        if CAUSAL:
            allowed = allowed & (keys <= last_key)
        else:
            allowed = allowed & (tl.load(m_row + keys * mask_sk, mask=keys < s_k, other=0) != 0)
        x = tl.load(s_row + keys, mask=keys < s_k, other=0.0).to(tl.float32) * scale
        x = tl.where(allowed, x, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all masked so far
        total = total * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    inverse = 1.0 / tl.where(total > 0.0, total, float("inf"))  # fully masked row: zeros
    for start in range(0, s_k, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        allowed = keys < s_k
        if CAUSAL:
            allowed = allowed & (keys <= last_key)
        else:
            allowed = allowed & (tl.load(m_row + keys * mask_sk, mask=keys < s_k, other=0) != 0)
        x = tl.load(s_row + keys, mask=keys < s_k, other=0.0).to(tl.float32) * scale
        probs = tl.where(allowed, tl.exp(x - shift) * inverse, 0.0)
        tl.store(p_row + keys, probs.to(P.dtype.element_ty), mask=keys < s_k)


@triton.jit
def _softmax_backward(P, DP, DS, s_k, scale, BLOCK: tl.constexpr):
    """One program per row: dx = scale * y * (dy - sum(dy * y))."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, s_k, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        y = tl.load(P + row * s_k + keys, mask=keys < s_k, other=0.0).to(tl.float32)
        dy = tl.load(DP + row * s_k + keys, mask=keys < s_k, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, s_k, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        y = tl.load(P + row * s_k + keys, mask=keys < s_k, other=0.0).to(tl.float32)
        dy = tl.load(DP + row * s_k + keys, mask=keys < s_k, other=0.0).to(tl.float32)
        dx = scale * y * (dy - dot)
        tl.store(DS + row * s_k + keys, dx.to(DS.dtype.element_ty), mask=keys < s_k)
