"""A micro-batch split over the ranks of a context-parallel group, and put back together.

Context parallelism (CP) gives each of the `cp` ranks of a group a part of every sequence. With a
causal mask a query at position q attends to q + 1 keys, so cutting the sequence into `cp`
consecutive parts would give the last rank most of the work. Megatron's load balancing cuts it
into 2 x CP equal chunks instead and gives rank r chunks r and 2 x CP - 1 - r (an early and a
late one): every rank then has the same number of (query, key) pairs. For CP 2 and a sequence
of 8 tokens:

    chunks    0: [0 1]   1: [2 3]   2: [4 5]   3: [6 7]
    rank 0    [0 1 6 7]            rank 1    [2 3 4 5]

Position ids stay the GLOBAL positions (rotary and learned embeddings follow the token, not its
place on the rank), so the split batch always carries them. The attention mask keeps every key
column and only its rows of this rank's queries: the CP attention sees keys from every rank.
Under --reset-attention-mask with CP the batch carries per-token document ids ([b, s],
data/masks.py) in the mask's place instead; they split like the tokens.

Pure functions of tensors and sizes: no process group (the caller passes its CP rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megapipe.data.batch import TrainingBatch


def _check(seq_length: int, cp_size: int, cp_rank: int = 0) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of a group of {cp_size}")
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} does not split into 2 x {cp_size} equal chunks"
        )


def chunk_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions rank `cp_rank` holds, in its order: chunk r, then chunk 2CP-1-r."""
    if cp_size == 1 and cp_rank == 0:
        return torch.arange(seq_length)  # the whole sequence, of any length
    _check(seq_length, cp_size, cp_rank)
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk),
         torch.arange(second * chunk, (second + 1) * chunk)]
    )  # fmt: skip


def split_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along its sequence dimension `dim`."""
    index = chunk_positions(tensor.shape[dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, index)


def gather_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `split_sequence`: `parts[r]` from CP rank r, back in global order."""
    cp_size = len(parts)
    seq_length = sum(part.shape[dim] for part in parts)
    _check(seq_length, cp_size)
    held = torch.cat([chunk_positions(seq_length, cp_size, r) for r in range(cp_size)])
    order = torch.argsort(held).to(parts[0].device)
    return torch.cat(list(parts), dim=dim).index_select(dim, order)


def global_position_ids(batch: TrainingBatch) -> torch.Tensor:
    """The batch's position ids ([b, s]), or 0..s-1 for each sample when it has none."""
    if batch.position_ids is not None:
        return batch.position_ids
    b, s = batch.tokens.shape
    return torch.arange(s, device=batch.tokens.device).expand(b, s)


def _mask_dim(mask: torch.Tensor | None) -> int:
    """The sequence dimension to split: the query rows of a [b, 1, s, s] mask, the tokens of
    [b, s] document ids."""
    return 1 if mask is not None and mask.dim() == 2 else 2


def split_batch(batch: TrainingBatch, cp_size: int, cp_rank: int) -> TrainingBatch:
    """This CP rank's part of a micro-batch ([b, s] tensors -> [b, s / CP]); the mask
    ([b, 1, s, s]) keeps its query rows (-> [b, 1, s / CP, s]), document ids ([b, s]) split
    like the tokens. CP 1 returns `batch` itself."""
    if cp_size == 1:
        return batch
    split = lambda t, dim=1: None if t is None else split_sequence(t, cp_size, cp_rank, dim)
    return TrainingBatch(
        split(batch.tokens),
        split(batch.labels),
        split(batch.loss_mask),
        split(global_position_ids(batch)),
        split(batch.attention_mask, _mask_dim(batch.attention_mask)),
    )


def gather_batch(parts: Sequence[TrainingBatch]) -> TrainingBatch:
    """The inverse of `split_batch` (`parts[r]` from CP rank r). Position ids come back
    explicit (the global 0..s-1 where the batch had none)."""
    if len(parts) == 1:
        return parts[0]
    gather = lambda name, dim=1: (
        None
        if getattr(parts[0], name) is None
        else gather_sequence([getattr(p, name) for p in parts], dim)
    )
    return TrainingBatch(
        gather("tokens"),
        gather("labels"),
        gather("loss_mask"),
        gather("position_ids"),
        gather("attention_mask", _mask_dim(parts[0].attention_mask)),
    )
