"""Vocabulary-parallel embedding: each TP rank holds a contiguous slice of the vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.parallel.mappings import reduce_from_tp_region
from megapipe.parallel.state import Group


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

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(token_ids, self.weight)
        outside = (token_ids < self.start) | (token_ids >= self.end)
        local_ids = (token_ids - self.start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(partial, self.tp_group)
