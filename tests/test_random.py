"""The TP-aware RNG tracker: masks agree across TP ranks outside TP regions, differ inside."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed


def _masks(rank, world):
    state = ParallelState.build(tensor_model_parallel_size=world)
    tracker = RNGTracker(42, tp_rank=state.tp_rank)
    tracker.seed_default()
    ones = torch.ones(64)
    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    gathered = [torch.empty(3, 64) for _ in range(world)]
    dist.all_gather(gathered, torch.stack([outside, inside, after]))
    return [g.tolist() for g in gathered]


def test_default_stream_agrees_and_tp_stream_differs_across_tp_ranks():
    per_rank = run_distributed(_masks, 2)[0]
    (outside0, inside0, after0), (outside1, inside1, after1) = per_rank
    assert outside0 == outside1 and after0 == after1
    assert inside0 != inside1


def test_fork_leaves_the_default_stream_untouched_and_continues_its_own():
    tracker = RNGTracker(7)
    tracker.seed_default()
    plain = [torch.rand(4) for _ in range(2)]

    tracker = RNGTracker(7)
    tracker.seed_default()
    first = torch.rand(4)
    with tracker.fork():
        a = torch.rand(4)
        with tracker.fork():  # re-entrant: keeps drawing from the same stream
            b = torch.rand(4)
    with tracker.fork():
        c = torch.rand(4)
    second = torch.rand(4)
    assert torch.equal(first, plain[0]) and torch.equal(second, plain[1])
    assert not torch.equal(a, b) and not torch.equal(b, c)

    again = RNGTracker(7)
    with again.fork():
        assert torch.equal(torch.rand(4), a)
        assert torch.equal(torch.rand(4), b)
        assert torch.equal(torch.rand(4), c)


def test_state_dict_round_trip_reproduces_both_streams():
    tracker = RNGTracker(3)
    tracker.seed_default()
    saved = tracker.state_dict()
    with tracker.fork():
        expect_tp = torch.rand(5)
    expect_default = torch.rand(5)
    tracker.load_state_dict(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(5), expect_tp)
    assert torch.equal(torch.rand(5), expect_default)


def _replicas_with_dropout(rank, world):
    state = ParallelState.build(tensor_model_parallel_size=world)
    config = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=256,
        seq_length=8,
        attention_dropout=0.3,
        hidden_dropout=0.3,
    )
    tracker = RNGTracker(5, tp_rank=state.tp_rank)
    tracker.seed_default()
    model = GPTModel(config, state, tracker, seed=5).train()
    hidden = {}
    model.decoder.final_layernorm.register_forward_hook(
        lambda mod, args, out: hidden.setdefault("x", out.detach())
    )
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    model(tokens=tokens)
    gathered = [torch.empty_like(hidden["x"]) for _ in range(world)]
    dist.all_gather(gathered, hidden["x"])
    eval_model = GPTModel(config, state, tracker, seed=5).eval()
    eval_hidden = eval_model.decoder(eval_model.embedding(tokens, None), None)
    return [torch.equal(g, gathered[0]) for g in gathered], torch.equal(hidden["x"], eval_hidden)


def test_dropout_keeps_tp_replicas_identical():
    for identical, same_as_eval in run_distributed(_replicas_with_dropout, 2):
        assert all(identical)  # hidden dropout drew the same mask on both TP ranks
        assert not same_as_eval  # and dropout really was applied
