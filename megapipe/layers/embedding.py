"""Vocabulary-parallel embedding: each TP rank holds a contiguous slice of the vocabulary rows.

The lookup is an autograd Function that delivers its weight gradient itself
(`layers/weight_grad.py`), like the TP linears: so the word embedding, which on a one-stage
pipeline is also the output layer's weight, gets all its gradients from layers that claim it
(one per layer per micro-batch), whether a grad buffer takes them or autograd does. Its
gradient goes as rows (ids, output gradient) to the buffer, which adds a bf16/fp16 model's
straight into the fp32 `main_grad` (index_add_): a token repeated in a micro-batch is summed in
fp32, where a gradient table in the weight's dtype would round each micro-batch's sum to bf16
(1.6e-3 off in tests/test_bf16_weight_grad.py) and take a second vocabulary-sized tensor per
micro-batch. An fp32 model's gradient is still summed in a table first (the same numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.layers.weight_grad import WeightGradStore, claim_weight_grad, deliver_weight_grad
from megapipe.parallel.mappings import reduce_from_tp_region
from megapipe.parallel.state import Group


class _Lookup(torch.autograd.Function):
    """weight[ids], rows of `outside` ids zeroed; dW = the output gradient's rows added by id."""

    @staticmethod
    def forward(ctx, ids, weight, outside, store):
        ctx.weight, ctx.store = weight, store
        ctx.save_for_backward(ids, outside)
        out = F.embedding(ids, weight)
        return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad):
        ids, outside = ctx.saved_tensors
        weight, store = ctx.weight, ctx.store
        if not weight.requires_grad:
            return None, None, None, None
        if outside is not None:
            grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)

        def compute(in_backward: bool) -> tuple:
            rows = (ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
            return (deliver_weight_grad(weight, rows=rows, in_backward=in_backward),)

        if store is not None and store.is_deferring:
            store.defer(compute, [weight])
            return None, None, None, None
        return None, compute(True)[0], None, None


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The [start, end) token ids whose rows TP rank `tp_rank` holds."""
    per_rank = padded_vocab_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class VocabParallelEmbedding(torch.nn.Module):
    """Token ids -> vectors, rows split across TP ranks; one all-reduce assembles the result.

    padded_vocab_size: rows in total (a multiple of TP); vocab_size: the real vocabulary, whose
    rows are initialised independently of how much padding the layout needs.
    """

    def __init__(
        self,
        padded_vocab_size: int,
        embedding_dim: int,
        tp_group: Group,
        *,
        init_std: float,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.start, self.end = vocab_range(padded_vocab_size, tp_group.rank, tp_group.size)
        self.weight = make_param(
            ParamMeta(
                (padded_vocab_size, embedding_dim),
                tp_dim=0,
                init_std=init_std,
                init_rows=vocab_size,
            ),
            tp_group.size,
        )
        claim_weight_grad(self.weight)
        self.weight_grad_store: WeightGradStore | None = None  # set by WeightGradStore.attach

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        store = self.weight_grad_store
        if self.tp_group.size == 1:
            return _Lookup.apply(token_ids, self.weight, None, store)
        outside = (token_ids < self.start) | (token_ids >= self.end)
        local_ids = (token_ids - self.start).masked_fill(outside, 0)
        partial = _Lookup.apply(local_ids, self.weight, outside, store)
        return reduce_from_tp_region(partial, self.tp_group)
