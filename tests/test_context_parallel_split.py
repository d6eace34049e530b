"""The context-parallel data split: Megatron's load-balanced 2 x CP chunks, global positions,
every token on exactly one rank, the inverse, and equal causal work per rank."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.data.batch import TrainingBatch
from megapipe.data.context_parallel_split import (
    chunk_positions,
    gather_batch,
    gather_sequence,
    split_batch,
    split_sequence,
)


def _batch(b: int, s: int, *, positions: bool = False, mask: bool = False) -> TrainingBatch:
    tokens = torch.arange(b * s).reshape(b, s) + 1000  # every token id distinct
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s)
    return TrainingBatch(
        tokens,
        tokens + 1,
        torch.rand(b, s),
        torch.randint(0, 4 * s, (b, s)) if positions else None,
        causal.clone() if mask else None,
    )


def test_hand_written_example_cp2_and_cp4():
    # chunks of 2: [0 1] [2 3] [4 5] [6 7]; rank r holds chunks r and 3 - r
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # 8 chunks of 2 for CP 4: rank r holds chunks r and 7 - r
    assert chunk_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert chunk_positions(16, 4, 2).tolist() == [4, 5, 10, 11]
    assert chunk_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    assert split_sequence(tokens, 2, 0).tolist() == [[10, 11, 16, 17]]
    assert split_sequence(tokens, 2, 1).tolist() == [[12, 13, 14, 15]]


@settings(max_examples=40, deadline=None)
@given(
    cp=st.integers(2, 5),  # CP 1 returns the batch itself (below)
    chunk=st.integers(1, 4),
    b=st.integers(1, 3),
    positions=st.booleans(),
    mask=st.booleans(),
)
def test_every_token_once_global_positions_and_the_inverse(cp, chunk, b, positions, mask):
    s = 2 * cp * chunk
    batch = _batch(b, s, positions=positions, mask=mask)
    parts = [split_batch(batch, cp, r) for r in range(cp)]
    seen = torch.cat([p.tokens for p in parts], dim=1)
    assert sorted(seen.flatten().tolist()) == sorted(batch.tokens.flatten().tolist())
    for r, part in enumerate(parts):
        held = chunk_positions(s, cp, r)
        assert part.tokens.shape == (b, s // cp)
        assert torch.equal(part.tokens, batch.tokens[:, held])
        assert torch.equal(part.labels, batch.labels[:, held])
        assert torch.equal(part.loss_mask, batch.loss_mask[:, held])
        # positions are the global ones: given, or 0..s-1 where the batch had none
        expected = batch.position_ids[:, held] if positions else held.expand(b, -1)
        assert torch.equal(part.position_ids, expected)
        if mask:  # this rank's query rows, every key column
            assert part.attention_mask.shape == (b, 1, s // cp, s)
            assert torch.equal(part.attention_mask, batch.attention_mask[:, :, held, :])
        else:
            assert part.attention_mask is None
    back = gather_batch(parts)
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert (
        torch.equal(back.attention_mask, batch.attention_mask)
        if mask
        else (back.attention_mask is None)
    )
    expected = batch.position_ids if positions else torch.arange(s).expand(b, s)
    assert torch.equal(back.position_ids, expected)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_chunks_in_chunk_order_rebuild_the_sequence(cp):
    s = 2 * cp * 3
    x = torch.randn(2, s, 5)
    parts = [split_sequence(x, cp, r) for r in range(cp)]
    half = s // (2 * cp)
    chunks = {}
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part[:, :half], part[:, half:]
    assert torch.equal(torch.cat([chunks[j] for j in range(2 * cp)], dim=1), x)
    assert torch.equal(gather_sequence(parts), x)
    # any sequence dimension: [s, b, h] as the model holds activations
    y = x.transpose(0, 1).contiguous()
    assert torch.equal(gather_sequence([split_sequence(y, cp, r, 0) for r in range(cp)], 0), y)


@pytest.mark.parametrize(("cp", "s"), [(2, 8), (2, 64), (3, 12), (4, 32), (8, 64)])
def test_causal_work_is_equal_across_ranks(cp, s):
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))  # (q, k) with q >= k
    work = [int(causal[chunk_positions(s, cp, r)].sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    assert sum(work) == s * (s + 1) // 2
    # the naive split (consecutive parts) is not balanced: the reason for 2 x CP chunks
    naive = [int(causal[r * s // cp : (r + 1) * s // cp].sum()) for r in range(cp)]
    assert len(set(naive)) == cp


def test_cp_one_is_the_batch_itself():
    batch = _batch(2, 6)
    assert split_batch(batch, 1, 0) is batch
    assert gather_batch([batch]) is batch


@pytest.mark.parametrize(("s", "cp", "rank"), [(6, 2, 0), (8, 2, 2), (8, 0, 0), (8, 2, -1)])
def test_impossible_splits_are_refused(s, cp, rank):
    with pytest.raises(ValueError):
        chunk_positions(s, cp, rank)
