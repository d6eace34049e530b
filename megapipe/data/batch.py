"""The micro-batch every pipeline stage reads: tokens, labels, loss mask, positions, mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainingBatch:
    """Inputs and targets of one micro-batch, all [micro_batch, seq_length].

    position_ids ([b, s]) and attention_mask ([b, 1, s, s], True = may attend) are None unless
    --reset-position-ids / --reset-attention-mask ask for them (the model then uses positions
    0..s-1 and a causal mask).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> TrainingBatch:
        """This batch with every tensor moved to `device`."""
        move = lambda t: None if t is None else t.to(device)
        return TrainingBatch(
            move(self.tokens),
            move(self.labels),
            move(self.loss_mask),
            move(self.position_ids),
            move(self.attention_mask),
        )
