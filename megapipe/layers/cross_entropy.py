"""Cross-entropy over vocabulary-parallel logits, without gathering the full vocabulary.

Each rank holds logits for its slice of the vocabulary and reduces it to three numbers per
token: its row max, its sum of exp(logit - row max), and the target's raw logit (0 where the
target is elsewhere). ONE all-gather of those [3, tokens] over the TP group gives every rank
the whole vocabulary's max, sum of exponentials and target logit (`combine_over_tp`), hence
the exact loss; the gradient (softmax minus one-hot) is computed locally from the saved
per-rank softmax. Megatron-LM all-reduces three times (max, then the sum and the target logit
at the shifted scale); on the CPU's gloo a small collective costs 0.2-0.4 ms whatever its size,
so one instead of two is what it saves. On one rank the loss is torch's fused log-softmax with
a backward in place.
"""

from __future__ import annotations

import math

import torch

from megapipe.parallel.mappings import all_gather_single
from megapipe.parallel.state import Group


def combine_over_tp(
    row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor, group: Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole vocabulary's (row max, sum of exp(logit - max), target logit) from each TP
    rank's own, fp32 [tokens] each, with one all-gather.

    A rank's sum is rescaled to the global max by exp(its max - global max) (0 for a rank
    holding only padding: its max is -inf and its sum 0). Every rank adds the same gathered
    values in the same order, so all TP ranks get bit-identical results.
    """
    stats = torch.stack([row_max, sum_exp, target_logit])
    gathered = stats.new_empty((group.size * stats.numel(),))
    all_gather_single(gathered, stats.reshape(-1), group=group.pg)
    gathered = gathered.view(group.size, *stats.shape)
    maxes = gathered[:, 0]
    global_max = maxes.max(dim=0).values
    total = (gathered[:, 1] * torch.exp(maxes - global_max)).sum(dim=0)
    return global_max, total, gathered[:, 2].sum(dim=0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, start: int, valid: int
    ):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        if valid > 0:
            row_max = logits[..., :valid].max(dim=-1).values
        else:  # this rank holds only padding rows
            row_max = logits.new_full(logits.shape[:-1], float("-inf"))
        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        if valid < local_vocab:  # a padding target has no probability: an infinite loss
            target_logit = target_logit.masked_fill(~outside & (local_target >= valid), -math.inf)

        exp = logits - row_max.unsqueeze(-1)
        if valid < local_vocab:
            exp[..., valid:] = float("-inf")  # padding never takes probability mass
        exp = exp.exp_()
        sum_exp = exp.sum(dim=-1)
        scale = None
        if group.size > 1:
            local_max = row_max
            row_max, sum_exp, target_logit = combine_over_tp(row_max, sum_exp, target_logit, group)
            scale = torch.exp(local_max - row_max)  # this rank's exponentials at the global max
        loss = sum_exp.log() + row_max - target_logit

        scale = 1.0 / sum_exp if scale is None else scale / sum_exp
        softmax = exp.mul_(scale.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        _consume_once(ctx)
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # the saved softmax becomes the gradient, in place: no [tokens, vocab] copy
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def _consume_once(ctx) -> None:
    """The cross-entropy backwards write the gradient into their saved [tokens, vocab] tensor
    instead of a new one, so they can run once."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError(
            "cross-entropy backward ran twice over the same graph (retain_graph=True): its saved "
            "softmax was already turned into the gradient"
        )
    ctx.consumed = True


class _OneRankCrossEntropy(torch.autograd.Function):
    """Cross-entropy when one rank holds the whole vocabulary: torch's fused log-softmax in
    forward, and a backward that turns the saved log-probabilities into the gradient in place
    (exp, scale, subtract at the targets). `F.cross_entropy`'s own backward zero-fills a new
    [tokens, vocab] tensor, scatters into it and runs log_softmax's backward into another (two
    large allocations; the fill alone was 3.3 ms a step at PP=2's last stage, in
    benchmarks/RESULTS.md's session-4 profile)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_probs, target)
        return -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        _consume_once(ctx)
        log_probs, target = ctx.saved_tensors
        grad = log_probs.exp_()  # softmax
        scale = grad_loss.unsqueeze(-1)
        grad.mul_(scale)
        grad.scatter_add_(-1, target.unsqueeze(-1), -scale)  # softmax - one_hot, times scale
        return grad, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss, same shape as `target`.

    logits: [..., vocab/tp], this rank's slice starting at token id `vocab_start`.
    target: [...] token ids in the full vocabulary. Computed in fp32 whatever the logits' dtype.
    vocab_size: the real vocabulary; logits of padding ids (>= vocab_size) are excluded from
        the softmax. Megatron lets them compete, which makes the model depend on how much
        padding the TP size needs; excluding them keeps every layout the same model.
    """
    local = logits.shape[-1]
    valid = local if vocab_size is None else max(0, min(local, vocab_size - vocab_start))
    if group.size == 1 and vocab_start == 0 and valid > 0:
        # One rank holds the whole vocabulary: torch's fused log-softmax, with a backward in
        # place (same fp32 math, padding excluded by slicing it off) at about half the time.
        flat = logits[..., :valid].float().reshape(-1, valid)
        return _OneRankCrossEntropy.apply(flat, target.reshape(-1)).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, valid)


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean loss over tokens whose mask is 1 (all tokens when no mask)."""
    if loss_mask is None:
        return per_token_loss.mean()
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def context_parallel_masked_mean(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None, cp: Group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole sequences' mean loss, detached; the loss this CP rank's backward starts from).

    Each rank of the CP group holds its chunks of the micro-batch's sequences: the masked sums
    and token counts are summed over the group, and the backward loss is CP x (local masked
    sum / global count), so that averaging the gradients over DP x CP (Megatron's
    `loss * cp_size` convention) gives the gradient of the global mean."""
    mask = torch.ones_like(per_token_loss) if loss_mask is None else loss_mask
    mask = mask.to(per_token_loss.dtype)
    local = (per_token_loss * mask).sum()
    totals = torch.stack([local.detach(), mask.sum()]).float()
    if cp.size > 1:
        torch.distributed.all_reduce(totals, group=cp.pg)
    count = totals[1].clamp(min=1.0)
    return totals[0] / count, local * (cp.size / count.to(local.dtype))
