"""Triton per-token work of the chunked vocabulary-parallel cross-entropy.

One program per token streams its row of local logits in blocks: the forward keeps an online
max and sum of exponentials in fp32 (and picks the target logit), the backward writes
(softmax - onehot) * grad from the saved log-sum-exp. No temporary beyond the outputs; the TP
all-reduces stay in torch (`megapipe/kernels/cross_entropy.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # columns per block


def _options(valid: int, block_size: int | None) -> dict:
    block = block_size or min(triton.next_power_of_2(max(valid, 1)), MAX_BLOCK)
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8}


def local_stats(
    rows: torch.Tensor, local_target: torch.Tensor, valid: int, block_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of rows [tokens, local vocab]: this rank's max and sum of exp(logit - max)
    over the first `valid` columns, and the raw target logit (0 where local_target is -1,
    -inf on a padding column), all fp32."""
    tokens = rows.shape[0]
    stats = torch.empty((3, tokens), dtype=torch.float32, device=rows.device)
    if tokens > 0:
        _ce_forward[(tokens,)](
            rows, local_target, stats[0], stats[1], stats[2], rows.stride(0), valid,
            **_options(valid, block_size),
        )  # fmt: skip
    return stats[0], stats[1], stats[2]


def local_grad(
    rows: torch.Tensor,
    local_target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    valid: int,
    block_size: int | None,
) -> torch.Tensor:
    """(exp(logit - lse) - onehot) * grad_loss per token, zero on padding, in rows' dtype."""
    grad = torch.empty_like(rows)
    tokens, local = rows.shape
    if tokens > 0:
        _ce_backward[(tokens,)](
            rows, local_target, lse, grad_loss.contiguous(), grad, rows.stride(0), grad.stride(0),
            local, valid, **_options(local, block_size),
        )  # fmt: skip
    return grad


@triton.jit
def _ce_forward(X, T, MAX, SUM, TARGET, stride_x, valid, BLOCK: tl.constexpr):
    """One program per token: online max and sum of exponentials over the real columns,
    and the raw target logit (-1 in T: the target is on another rank)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    row_max = float("-inf")
    total = 0.0
    for start in range(0, valid, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        total = total * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    tl.store(MAX + row, row_max)
    tl.store(SUM + row, total)
    target = tl.load(T + row)
    hit = target >= 0
    logit = tl.load(x_row + tl.where(hit, target, 0)).to(tl.float32)
    logit = tl.where(target < valid, logit, float("-inf"))  # a padding id, as the reference
    tl.store(TARGET + row, tl.where(hit, logit, 0.0))


@triton.jit
def _ce_backward(
    X, T, LSE, DLOSS, DX, stride_x, stride_dx, local, valid, BLOCK: tl.constexpr
):  # fmt: skip
    """One program per token: dx = (exp(x - lse) - onehot(target)) * dloss, streamed."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row)
    scale = tl.load(DLOSS + row)
    target = tl.load(T + row)
    for start in range(0, local, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < valid, other=float("-inf"))
        probs = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == target, 1.0, 0.0)
        dx = (probs * scale).to(DX.dtype.element_ty)
        tl.store(DX + row * stride_dx + cols, dx, mask=cols < local)
