"""Mock samples depend only on (seed, global index), and the DP/micro-batch slicing of each
global batch covers it exactly once, whatever the layout."""

from __future__ import annotations

import pytest
import torch

from megapipe.data import MockGPTDataset, micro_batch_range


def test_samples_depend_only_on_seed_and_index() -> None:
    data = MockGPTDataset(vocab_size=300, seq_length=16, seed=7)
    whole = data.batch(range(0, 8))
    part = data.batch(range(3, 5))  # another rank reading a slice sees the same samples
    assert torch.equal(part.tokens, whole.tokens[3:5])
    assert torch.equal(part.labels, whole.labels[3:5])
    again = MockGPTDataset(vocab_size=300, seq_length=16, seed=7).sample(4)
    assert torch.equal(again, data.sample(4))
    other_seed = MockGPTDataset(vocab_size=300, seq_length=16, seed=8)
    assert not torch.equal(other_seed.batch(range(0, 8)).tokens, whole.tokens)
    assert len({tuple(row.tolist()) for row in whole.tokens}) == 8  # samples differ


def test_batch_shapes_shift_and_range() -> None:
    data = MockGPTDataset(vocab_size=50, seq_length=12, seed=1)
    batch = data.batch(range(10, 16))
    assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape == (6, 12)
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64
    full = torch.stack([data.sample(i) for i in range(10, 16)])
    assert full.shape == (6, 13)
    assert torch.equal(batch.tokens, full[:, :-1]) and torch.equal(batch.labels, full[:, 1:])
    assert int(full.min()) >= 0 and int(full.max()) < 50
    assert torch.all(batch.loss_mask == 1)
    with pytest.raises(IndexError):
        data.sample(-1)


@pytest.mark.parametrize(("gbs", "mbs", "dp"), [(8, 2, 1), (8, 2, 2), (8, 1, 4), (12, 3, 2)])
def test_micro_batches_tile_each_global_batch(gbs: int, mbs: int, dp: int) -> None:
    num_micro = gbs // (mbs * dp)
    for iteration in range(3):
        seen: list[int] = []
        for rank in range(dp):
            rank_samples: list[int] = []
            for micro in range(num_micro):
                r = micro_batch_range(
                    iteration,
                    micro,
                    global_batch_size=gbs,
                    micro_batch_size=mbs,
                    data_parallel_rank=rank,
                    data_parallel_size=dp,
                )
                assert len(r) == mbs
                rank_samples += list(r)
            # each DP rank reads one contiguous slice of the global batch
            per_rank = gbs // dp
            start = iteration * gbs + rank * per_rank
            assert rank_samples == list(range(start, start + per_rank))
            seen += rank_samples
        assert sorted(seen) == list(range(iteration * gbs, (iteration + 1) * gbs))


def test_micro_batch_range_rejects_impossible_splits() -> None:
    kwargs = dict(micro_batch_size=2, data_parallel_rank=0, data_parallel_size=2)
    with pytest.raises(ValueError):
        micro_batch_range(0, 0, global_batch_size=6, **kwargs)
    with pytest.raises(IndexError):
        micro_batch_range(0, 2, global_batch_size=8, **kwargs)
