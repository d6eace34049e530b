"""The micro-batch every pipeline stage reads: tokens, labels, loss mask, positions, mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`, without stalling the host: a host tensor bound for a GPU is pinned
    and copied with non_blocking (a pageable copy waits for the GPU, then for the copy);
    elsewhere a plain `.to`."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass(frozen=True)
class TrainingBatch:
    """Inputs and targets of one micro-batch, all [micro_batch, seq_length].

    position_ids ([b, s]) and attention_mask ([b, 1, s, s], True = may attend) are None unless
    --reset-position-ids / --reset-attention-mask ask for them (the model then uses positions
    0..s-1 and a causal mask). Under context parallelism attention_mask holds per-token
    document ids ([b, s] ints) instead of the [b, 1, s, s] mask (data/masks.py).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> TrainingBatch:
        """This batch with every tensor moved to `device` (see `to_device`)."""
        move = lambda t: None if t is None else to_device(t, device)
        return TrainingBatch(
            move(self.tokens),
            move(self.labels),
            move(self.loss_mask),
            move(self.position_ids),
            move(self.attention_mask),
        )
