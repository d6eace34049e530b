"""Layout-invariant dropout masks: a rank's mask is its slice of one logical mask per sample."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.model import GPTModel
from megapipe.model.attention import explicit_attention
from megapipe.model.dropout import LogicalDropout, logical_keep_mask, mask_seed
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState

SEED = 17
P = 0.1


def test_mask_is_a_pure_function_of_seed_sample_layer_and_site():
    key = (SEED, 5, 2, "mlp_output")
    a = logical_keep_mask(*key, (16, 32), P)
    torch.rand(7)  # draws elsewhere do not move it
    assert torch.equal(a, logical_keep_mask(*key, (16, 32), P))
    for other in [(SEED + 1, 5, 2, "mlp_output"), (SEED, 6, 2, "mlp_output"),
                  (SEED, 5, 3, "mlp_output"), (SEED, 5, 2, "attention_output")]:  # fmt: skip
        assert not torch.equal(a, logical_keep_mask(*other, (16, 32), P)), other


def test_keep_probability_is_one_minus_p():
    for p in (0.1, 0.5):
        keep = logical_keep_mask(SEED, 0, 0, "attention_probs", (64, 64, 64), p)
        n = keep.numel()
        assert abs(keep.float().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)


def test_unknown_site_and_bad_probability_are_refused():
    with pytest.raises(ValueError, match="unknown dropout site 'mlp'"):
        mask_seed(SEED, 0, 0, "mlp")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\), got 1.0"):
        logical_keep_mask(SEED, 0, 0, "embedding", (2,), 1.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_shards_concatenate_to_the_single_rank_mask(tp):
    ids = torch.tensor([3, 11, 4])
    s, b, h = 16, 3, 8
    full = LogicalDropout(SEED, ids).hidden_keep_mask((s, b, h), P, 1, "attention_output", "cpu")
    shards = [
        LogicalDropout(SEED, ids, tp_rank=r, tp_size=tp, sequence_parallel=True).hidden_keep_mask(
            (s // tp, b, h), P, 1, "attention_output", "cpu"
        )
        for r in range(tp)
    ]
    assert torch.equal(torch.cat(shards), full)
    # Replicated activations (no SP): every TP rank draws the whole mask, identical replicas.
    replica = LogicalDropout(SEED, ids, tp_rank=1, tp_size=tp).hidden_keep_mask(
        (s, b, h), P, 1, "attention_output", "cpu"
    )
    assert torch.equal(replica, full)


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_shards_are_head_slices_of_the_single_rank_mask(tp):
    ids = torch.tensor([8, 2])
    b, heads, s = 2, 8, 6
    full = LogicalDropout(SEED, ids).attention_keep_mask((b, heads, s, s), P, 0, "cpu")
    shards = [
        LogicalDropout(SEED, ids, tp_rank=r, tp_size=tp).attention_keep_mask(
            (b, heads // tp, s, s), P, 0, "cpu"
        )
        for r in range(tp)
    ]
    assert torch.equal(torch.cat(shards, dim=1), full)


def test_a_sample_gets_its_mask_whatever_micro_batch_slot_carries_it():
    pair = LogicalDropout(SEED, torch.tensor([5, 9])).hidden_keep_mask(
        (4, 2, 8), P, 0, "embedding", "cpu"
    )
    alone = LogicalDropout(SEED, torch.tensor([9])).hidden_keep_mask(
        (4, 1, 8), P, 0, "embedding", "cpu"
    )
    assert torch.equal(pair[:, 1:], alone)
    assert not torch.equal(pair[:, :1], alone)  # different samples, different masks


def test_hidden_dropout_zeroes_or_rescales_and_checks_the_batch():
    masks = LogicalDropout(SEED, torch.tensor([0, 1]))
    x = torch.randn(4, 2, 8)
    y = masks.hidden(x, 0.5, 0, "mlp_output")
    keep = masks.hidden_keep_mask((4, 2, 8), 0.5, 0, "mlp_output", "cpu")
    assert torch.equal(y, torch.where(keep, x * 2.0, torch.zeros(())))
    assert masks.hidden(x, 0.0, 0, "mlp_output") is x
    with pytest.raises(ValueError, match="micro-batch 3 but 2 sample ids"):
        masks.hidden(torch.randn(4, 3, 8), 0.5, 0, "mlp_output")


def _probabilities(q, k, mask):
    """softmax(q k^T / sqrt(d)) from SDPA itself: attention over an identity value matrix."""
    s = q.shape[2]
    eye = torch.eye(s).expand(*q.shape[:2], s, s)
    return F.scaled_dot_product_attention(q, k, eye, attn_mask=mask, is_causal=mask is None)


@pytest.mark.parametrize("with_mask", [False, True])
def test_explicit_attention_is_sdpa_with_our_mask_on_the_probabilities(with_mask):
    g = torch.Generator().manual_seed(0)
    b, heads, groups, s, d = 2, 4, 2, 6, 8
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = (torch.randn(b, groups, s, d, generator=g) for _ in range(2))
    mask = None
    if with_mask:  # two documents per sample: causal within each
        doc = torch.tensor([0, 0, 0, 1, 1, 1])
        mask = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        mask = mask.expand(b, 1, s, s)
    scale = 1 / math.sqrt(d)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    same = explicit_attention(q, k, v, mask, scale, lambda probs: probs)
    assert (same - sdpa).abs().max() < 1e-6

    keep = torch.rand(b, heads, s, s, generator=g) > 0.3
    dropped = explicit_attention(q, k, v, mask, scale, lambda probs: probs * keep / 0.7)
    k_full, v_full = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    expected = (_probabilities(q, k_full, mask) * keep / 0.7) @ v_full
    assert (dropped - expected).abs().max() < 1e-6


CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=8,
    attention_dropout=P,
    hidden_dropout=P,
)


def _model(config: ModelConfig = CONFIG) -> GPTModel:
    return GPTModel(config, ParallelState.single(), RNGTracker(SEED), seed=SEED).train()


def test_model_dropout_is_keyed_by_sample_ids():
    model = _model()
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([40, 41])
    with torch.no_grad():
        a = model(tokens=tokens, sample_ids=ids)
        torch.rand(3)
        b = model(tokens=tokens, sample_ids=ids)
        other = model(tokens=tokens, sample_ids=torch.tensor([40, 42]))
        evaluated = model.eval()(tokens=tokens, sample_ids=ids)
    assert torch.equal(a, b)  # no hidden stream state: the same ids give the same masks
    assert torch.equal(a[:, 0], other[:, 0]) and not torch.equal(a[:, 1], other[:, 1])
    assert not torch.equal(a, evaluated)  # dropout was applied in training


def test_without_dropout_sample_ids_change_nothing():
    model = _model(dataclasses.replace(CONFIG, attention_dropout=0.0, hidden_dropout=0.0))
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(tokens=tokens)
        with_ids = model(tokens=tokens, sample_ids=torch.tensor([0, 1]))
    assert torch.equal(plain, with_ids)
