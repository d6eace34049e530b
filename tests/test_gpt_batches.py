"""Micro-batches from a GPT dataset: masks and position ids as Megatron's loop defines them,
each data-parallel rank reading its slice of the global batch, and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megapipe.data.errors import DataError
from megapipe.data.gpt_batches import GPTBatchSource
from megapipe.data.masks import MaskOptions, attention_mask, loss_mask, position_ids
from megapipe.data.sampler import micro_batch_range

EOD = 0


def reference_masks(data: torch.Tensor, options: MaskOptions):
    """Megatron's classic _get_ltor_masks_and_position_ids for one sample, transcribed."""
    seq = data.numel()
    mask = torch.tril(torch.ones(seq, seq)).unsqueeze(0)
    losses = torch.ones(seq)
    if options.eod_mask_loss:
        losses[data == options.eod] = 0.0
    positions = torch.arange(seq)
    if options.reset_position_ids or options.reset_attention_mask:
        eod_index = positions[data == options.eod].clone()
        prev = 0
        for i in eod_index.tolist():
            if options.reset_attention_mask:
                mask[0, (i + 1) :, : (i + 1)] = 0
            if options.reset_position_ids:
                positions[(i + 1) :] -= i + 1 - prev
                prev = i + 1
    return mask < 0.5, losses, positions  # Megatron's mask: True = masked out


@pytest.mark.parametrize(
    "flags", [(False, False, False), (True, True, True), (False, True, False), (True, False, True)]
)
def test_masks_match_megatron(flags) -> None:
    options = MaskOptions(EOD, *flags)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (6, 24), generator=generator)  # eod (0) about one in five
    tokens[0, -1] = EOD
    tokens[1] = 3  # no eod at all
    attention = attention_mask(tokens, options)
    assert attention.shape == (6, 1, 24, 24) and attention.dtype == torch.bool
    for row in range(6):
        mask, losses, positions = reference_masks(tokens[row], options)
        assert torch.equal(loss_mask(tokens, options)[row], losses)
        assert torch.equal(position_ids(tokens, options)[row], positions)
        if options.reset_attention_mask:
            assert torch.equal(attention[row], ~mask)  # ours: True = may attend


class CountingDataset:
    """Sample i is [i, i + 1, ..., i + seq] (mod 50), with eods where the value is 0."""

    def __init__(self, size: int, seq: int) -> None:
        self.size, self.seq, self.reads = size, seq, []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        self.reads.append(index)
        return (np.arange(self.seq + 1) + index) % 50


def test_batches_shift_labels_and_add_requested_fields() -> None:
    source = GPTBatchSource(CountingDataset(100, 8), 50, MaskOptions(EOD, True, True, True))
    batch = source.batch(range(45, 48))
    assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape == (3, 8)
    assert batch.tokens[0].tolist() == [45, 46, 47, 48, 49, 0, 1, 2]
    assert batch.labels[0].tolist() == [46, 47, 48, 49, 0, 1, 2, 3]
    assert batch.loss_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 1, 1]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert batch.attention_mask.shape == (3, 1, 8, 8) and not batch.attention_mask[0, 0, 6, 5]
    plain = GPTBatchSource(CountingDataset(100, 8), 50, MaskOptions(EOD)).batch(range(45, 48))
    assert plain.position_ids is None and plain.attention_mask is None
    assert torch.all(plain.loss_mask == 1)
    assert plain.to("cpu").attention_mask is None


def test_data_parallel_ranks_read_their_slice_and_resume_is_exact() -> None:
    gbs, mbs, dp = 8, 2, 2
    dataset = CountingDataset(1000, 8)
    source = GPTBatchSource(dataset, 50, MaskOptions(EOD))
    for iteration in range(3):
        seen = []
        for rank in range(dp):
            for micro in range(gbs // (mbs * dp)):
                dataset.reads.clear()
                indices = micro_batch_range(
                    iteration,
                    micro,
                    global_batch_size=gbs,
                    micro_batch_size=mbs,
                    data_parallel_rank=rank,
                    data_parallel_size=dp,
                )
                source.batch(indices)
                assert dataset.reads == list(indices)  # a rank reads only its own samples
                seen += dataset.reads
        assert sorted(seen) == list(range(iteration * gbs, (iteration + 1) * gbs))
    # A fresh source (a resumed run) reads at iteration 2 exactly what a continuous run reads.
    resumed = GPTBatchSource(CountingDataset(1000, 8), 50, MaskOptions(EOD))
    indices = micro_batch_range(
        2,
        1,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        data_parallel_rank=1,
        data_parallel_size=dp,
    )
    assert torch.equal(resumed.batch(indices).tokens, source.batch(indices).tokens)


def test_bad_samples_are_named() -> None:
    source = GPTBatchSource(CountingDataset(50, 8), 40, MaskOptions(EOD))
    with pytest.raises(DataError, match="samples 35..36 hold token id 44, outside the tokenizer's"):
        source.batch(range(35, 37))
    source = GPTBatchSource(CountingDataset(10, 8), 50, MaskOptions(EOD))
    with pytest.raises(DataError, match="train sample 10 is beyond the 10 train samples built"):
        source.batch(range(9, 11))
