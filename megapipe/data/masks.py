"""Loss mask, position ids and attention mask of left-to-right samples, as Megatron's
`_get_ltor_masks_and_position_ids` defines them, vectorised over the batch.

- --eod-mask-loss: no loss where the *input* token is the eod (predicting across documents);
- --reset-position-ids: positions restart at 0 after each eod;
- --reset-attention-mask: a token attends only to earlier tokens of its own document.

The eod closes its document: it belongs to the segment before it. The attention mask here is
`True = may attend`, [b, 1, s, s], as torch's scaled_dot_product_attention takes it (Megatron's
own is the negation: True = masked out).

Under context parallelism (`document_ids` set) the batch carries each token's document number
([b, s], `document_segments`) in place of that mask: the CP ranks split it like the tokens and
the CP attention masks by it, with no [s, s] mask ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskOptions:
    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    document_ids: bool = False  # --reset-attention-mask as [b, s] document ids (CP > 1)


def document_segments(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] segment number of each token: the count of eods strictly before it."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def loss_mask(tokens: torch.Tensor, options: MaskOptions) -> torch.Tensor:
    mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    if options.eod_mask_loss:
        mask[tokens == options.eod] = 0.0
    return mask


def position_ids(tokens: torch.Tensor, options: MaskOptions) -> torch.Tensor:
    """[b, s] positions, restarting after each eod when reset_position_ids."""
    seq = tokens.shape[-1]
    positions = torch.arange(seq, device=tokens.device).expand(tokens.shape)
    if not options.reset_position_ids:
        return positions.clone()
    after_eod = torch.where(tokens == options.eod, positions + 1, torch.zeros_like(positions))
    start = torch.cummax(after_eod, dim=-1).values  # first position after the latest eod
    start = torch.cat([torch.zeros_like(start[:, :1]), start[:, :-1]], dim=-1)  # strictly before
    return positions - start


def attention_mask(tokens: torch.Tensor, options: MaskOptions) -> torch.Tensor:
    """[b, 1, s, s] bool, True where query q may attend key k: k <= q, same document."""
    seq = tokens.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    segments = document_segments(tokens, options.eod)
    same = segments.unsqueeze(-1) == segments.unsqueeze(-2)
    return (causal & same).unsqueeze(1)
