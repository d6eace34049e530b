"""Vocabulary-parallel cross-entropy that never materialises the softmax, chunked over the vocab.

The reference is `megapipe.layers.cross_entropy.vocab_parallel_cross_entropy` (re-exported here
as `cross_entropy_reference`): same arguments, same loss and gradient. It keeps the fp32
softmax, one more [s, b, V/tp] tensor, for backward; this op keeps the logits themselves (which
the caller holds anyway while the loss is computed) and two numbers per token:

forward, per rank, over chunks of the local vocabulary (padding ids >= vocab_size skipped): a
running row max and sum of exponentials in fp32, and the raw target logit on the rank that holds
the target. Then one all-gather over TP of those [3, tokens], as the reference
(`combine_over_tp`: each rank's sum rescaled to the global max, the target logit zero on ranks
without it). loss = max + log(sum) - target logit. The log-sum-exp is saved.

backward recomputes softmax = exp(logit - lse) chunk by chunk, subtracts the one-hot target and
scales by the incoming gradient, writing each chunk of the gradient (in the logits' dtype); no
collective. Padding columns get zero gradient.

`chunked_cross_entropy` does the per-chunk work in torch (CPU and GPU; temporaries of
`chunk_size` columns); `chunked_cross_entropy_triton` does it with one Triton program per token
that streams the row, keeping no temporary at all.
"""

from __future__ import annotations

import torch

from megapipe.layers.cross_entropy import combine_over_tp
from megapipe.layers.cross_entropy import vocab_parallel_cross_entropy as cross_entropy_reference
from megapipe.parallel.state import Group

__all__ = ["chunked_cross_entropy", "chunked_cross_entropy_triton", "cross_entropy_reference"]

CHUNK_ELEMENTS = 1 << 24  # the torch path's fp32 temporaries: at most this many elements each


def chunked_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss, same shape as `target`; arguments as `cross_entropy_reference`.

    chunk_size: vocabulary columns per chunk (default: CHUNK_ELEMENTS / tokens, at least 128).
    """
    return _apply(logits, target, group, vocab_start, vocab_size, chunk_size, triton_kernels=False)


def chunked_cross_entropy_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """`chunked_cross_entropy` with the per-token work in Triton kernels (block_size columns)."""
    return _apply(logits, target, group, vocab_start, vocab_size, block_size, triton_kernels=True)


def _apply(logits, target, group, vocab_start, vocab_size, chunk, *, triton_kernels):
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}"
        )
    local = logits.shape[-1]
    valid = local if vocab_size is None else max(0, min(local, vocab_size - vocab_start))
    return _ChunkedCrossEntropy.apply(
        logits, target, group, vocab_start, valid, chunk, triton_kernels
    )


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, valid, chunk, triton_kernels):
        local = logits.shape[-1]
        rows = logits.reshape(-1, local)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        local_target = target.reshape(-1).long() - start
        local_target = local_target.masked_fill((local_target < 0) | (local_target >= local), -1)
        if triton_kernels:
            from megapipe.kernels.triton_ops.cross_entropy import local_stats

            row_max, sum_exp, target_logit = local_stats(rows, local_target, valid, chunk)
        else:
            row_max, sum_exp, target_logit = _torch_stats(rows, local_target, valid, chunk)
        if group.size > 1:
            row_max, sum_exp, target_logit = combine_over_tp(row_max, sum_exp, target_logit, group)
        lse = row_max + torch.log(sum_exp)
        ctx.save_for_backward(rows, local_target, lse)
        ctx.valid, ctx.chunk, ctx.triton_kernels = valid, chunk, triton_kernels
        ctx.shape = logits.shape
        return (lse - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, local_target, lse = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1).float()
        if ctx.triton_kernels:
            from megapipe.kernels.triton_ops.cross_entropy import local_grad

            grad = local_grad(rows, local_target, lse, grad_loss, ctx.valid, ctx.chunk)
        else:
            grad = _torch_grad(rows, local_target, lse, grad_loss, ctx.valid, ctx.chunk)
        return grad.view(ctx.shape), None, None, None, None, None, None


def _chunk_columns(rows: torch.Tensor, chunk: int | None) -> int:
    if chunk is not None:
        return chunk
    return max(128, CHUNK_ELEMENTS // max(rows.shape[0], 1))


def _torch_stats(rows, local_target, valid, chunk):
    """This rank's row max and sum of exp(logit - max) over its real columns, in fp32 chunks,
    and the raw target logit (0 where the target is elsewhere; -inf on a padding column,
    as the reference)."""
    tokens = rows.shape[0]
    row_max = torch.full((tokens,), float("-inf"), dtype=torch.float32, device=rows.device)
    sum_exp = torch.zeros(tokens, dtype=torch.float32, device=rows.device)
    step = _chunk_columns(rows, chunk)
    for first in range(0, valid, step):
        x = rows[:, first : min(first + step, valid)].to(torch.float32, copy=True)
        new_max = torch.maximum(row_max, x.amax(dim=-1))
        sum_exp = sum_exp * torch.exp(row_max - new_max) + x.sub_(new_max[:, None]).exp_().sum(-1)
        row_max = new_max
    hit = local_target >= 0
    picked = rows.gather(1, local_target.clamp(min=0)[:, None]).squeeze(1).float()
    picked = picked.masked_fill(local_target >= valid, float("-inf"))
    return row_max, sum_exp, picked.masked_fill(~hit, 0.0)


def _torch_grad(rows, local_target, lse, grad_loss, valid, chunk):
    """(softmax - onehot) * grad_loss, chunk by chunk, in the logits' dtype."""
    grad = torch.empty_like(rows)
    step = _chunk_columns(rows, chunk)
    tokens = torch.arange(rows.shape[0], device=rows.device)
    for first in range(0, rows.shape[1], step):
        last = min(first + step, rows.shape[1])
        probs = rows[:, first:last].to(torch.float32, copy=True)
        probs.sub_(lse[:, None]).exp_()
        if last > valid:
            probs[:, max(valid - first, 0) :] = 0.0  # padding takes no probability mass
        here = (local_target >= first) & (local_target < last)
        probs[tokens[here], local_target[here] - first] -= 1.0
        grad[:, first:last] = probs.mul_(grad_loss[:, None])
    return grad


IMPLEMENTATIONS = {
    "reference": cross_entropy_reference,
    "triton": chunked_cross_entropy_triton,
}
