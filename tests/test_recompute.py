"""Activation recomputation (--recompute-granularity full|selective) changes memory, never
numbers: with dropout 0.1, losses and grad norms are bit-identical to the run without it, at
TP2+SP and at PP2 with interleaved stages; and the recomputed forward replays the RNG tracker's
streams (a control that skips the replay gets different gradients)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.config import ModelConfig, RecomputeConfig
from megapipe.errors import ConfigError
from megapipe.model.gpt import GPTModel
from megapipe.model.recompute import recomputed_groups
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "200",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3",
    "--log-interval", "100", "--clip-grad", "0.5", "--attention-dropout", "0.1",
    "--hidden-dropout", "0.1",
]  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-interleaved": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],  # fmt: skip
}
MODES = {
    "full-uniform": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],  # fmt: skip
    "full-block": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "1",
    ],  # fmt: skip
    "selective": [
        "--recompute-granularity",
        "selective",
        "--recompute-modules",
        "core_attn",
        "mlp",
    ],  # fmt: skip
}


def _train(rank: int, world: int, argv: list[str]) -> list[tuple[float, float]]:
    return [(r.lm_loss, r.grad_norm) for r in train_with_flags(rank, world, argv)[0]]


def _losses(layout: str, mode: list[str]) -> list[tuple[float, float]]:
    return run_distributed(_train, 2, BASE + LAYOUTS[layout] + mode)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_recomputation_is_bit_identical_in_training(layout: str) -> None:
    plain = _losses(layout, [])
    for name, mode in MODES.items():
        assert _losses(layout, mode) == plain, (layout, name)


def _grads(rank: int, world: int, recompute: RecomputeConfig, broken: bool, sp: bool):
    """One forward/backward of a TP2 model whose dropout draws from the rank's streams (no
    sample ids): the recomputation must replay them."""
    from megapipe.parallel.random import RNGTracker as Tracker

    if broken:  # the control: recompute without replaying the tracker's streams
        Tracker.replay = lambda self, snapshot: contextlib.nullcontext()
    config = ModelConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
        max_position_embeddings=16, attention_dropout=0.1, hidden_dropout=0.1,
    )  # fmt: skip
    state = ParallelState.build(2, 1)
    rng = RNGTracker(7, state.tp_rank)
    rng.seed_default()
    model = GPTModel(config, state, rng, seed=7, sequence_parallel=sp, recompute=recompute)
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens=tokens, labels=tokens).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_recomputation_replays_the_tracker_streams(sp: bool) -> None:
    full = RecomputeConfig("full", "uniform", 2)
    plain = run_distributed(_grads, 2, RecomputeConfig(), False, sp)
    replayed = run_distributed(_grads, 2, full, False, sp)
    broken = run_distributed(_grads, 2, full, True, sp)
    for rank in range(2):
        for name, grad in plain[rank].items():
            assert torch.equal(replayed[rank][name], grad), (rank, name)
        assert any(not torch.equal(broken[rank][n], g) for n, g in plain[rank].items())


def test_recomputed_groups() -> None:
    assert recomputed_groups(RecomputeConfig("full", "uniform", 2), 5) == [
        range(0, 2), range(2, 4), range(4, 5)
    ]  # fmt: skip
    assert recomputed_groups(RecomputeConfig("full", "block", 2), 5) == [range(0, 1), range(1, 2)]
    assert recomputed_groups(RecomputeConfig("selective"), 5) == []


MINIMAL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--mock-data", "--vocab-size", "100",
           "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--recompute-method", "block"],
         "--recompute-method block needs --recompute-granularity full"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
         "--recompute-num-layers 2 needs --recompute-granularity full"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
         "needs --recompute-method"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform"],
         "needs --recompute-num-layers"),
        (["--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2"],
         "--recompute-num-layers 3 exceeds the 2 layers of the smallest pipeline stage"),
        (["--recompute-granularity", "selective", "--recompute-modules", "attn"],
         "--recompute-modules attn: unknown module"),
        (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
         "--recompute-modules moe: megapipe recomputes only core_attn, mlp"),
    ],
)  # fmt: skip
def test_bad_recompute_flags_are_named(flags: list[str], message: str) -> None:
    world = 2 if "--pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args(MINIMAL + flags, world)


def test_recompute_activations_is_selective() -> None:
    configs = parse_args(MINIMAL + ["--recompute-activations"], 1)
    assert configs.recompute == RecomputeConfig("selective", None, None, ("core_attn",))
