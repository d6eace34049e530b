"""Context parallelism trains to the one-rank run: losses and grad norms within 1e-5.

Each layout runs `pretrain_gpt.py`'s own path (train_with_flags) with rotary embeddings, fp32
and dropout off on the same global batches as the one-rank reference: every CP rank keeps its
two chunks of each sequence (global positions), attention runs over the CP group, the loss is
the mean over every CP rank's tokens, and gradients are averaged over DP x CP.
"""

from __future__ import annotations

import numpy as np
import pytest

from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.testing import run_distributed, train_with_flags
from tests.helpers import PARITY_FLAGS, parity_losses_and_norms

TOLERANCE = 1e-5
ROPE = ["--position-embedding-type", "rope"]
CP2 = ["--context-parallel-size", "2"]

LAYOUTS = {
    "cp2-p2p": (2, CP2 + ["--cp-comm-type", "p2p"]),
    "cp2-all_gather": (2, CP2 + ["--cp-comm-type", "all_gather"]),
    "cp2-a2a": (2, CP2 + ["--cp-comm-type", "a2a"]),
    "cp2-tp2-sp": (4, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-dp2-distopt": (4, CP2 + ["--use-distributed-optimizer"]),
    "cp2-pp2": (4, CP2 + ["--pipeline-model-parallel-size", "2", "--emulate-nccl-p2p-order"]),
    "cp4": (4, ["--context-parallel-size", "4"]),
    "cp4-all_gather": (4, ["--context-parallel-size", "4", "--cp-comm-type", "all_gather"]),
    "cp4-a2a": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a"]),
    "cp2-pp2-dp2": (8, CP2 + ["--pipeline-model-parallel-size", "2", "--emulate-nccl-p2p-order"]),
    "cp2-dp2-zero3": (4, CP2 + ["--use-torch-fsdp2"]),
    "cp2-dp2-zero2": (4, CP2 + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                "optim_grads"]),
    "cp2-recompute-full": (2, CP2 + ["--recompute-granularity", "full", "--recompute-method",
                                     "uniform", "--recompute-num-layers", "1"]),
    "cp2-recompute-selective": (2, CP2 + ["--recompute-granularity", "selective"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return run_distributed(parity_losses_and_norms, 1, ROPE)[0]


def _assert_matches(runs, expected) -> None:
    losses, norms = expected
    for rank_losses, rank_norms in runs:
        assert rank_losses == pytest.approx(losses, rel=TOLERANCE)
        assert rank_norms == pytest.approx(norms, rel=TOLERANCE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layouts_match_one_rank(reference, layout):
    world, extra = LAYOUTS[layout]
    _assert_matches(run_distributed(parity_losses_and_norms, world, ROPE + extra), reference)


def test_hidden_dropout_with_context_parallelism_matches_one_rank():
    """Layout-invariant hidden dropout: a CP rank's masks are the whole sequence's at its
    global positions."""
    dropout = ROPE + ["--hidden-dropout", "0.1"]
    expected = run_distributed(parity_losses_and_norms, 1, dropout)[0]
    _assert_matches(run_distributed(parity_losses_and_norms, 2, dropout + CP2), expected)


def test_attention_dropout_with_context_parallelism_matches_one_rank():
    """Layout-invariant attention dropout (and hidden dropout) at 0.1: every CP rank applies the
    one-rank run's [heads, S, S] keep-mask at its (query, key) pairs' global positions, so CP2
    with each comm type trains to the one-rank losses and grad norms; the control shows the
    attention dropout moves them."""
    hidden = ROPE + ["--hidden-dropout", "0.1"]
    dropout = hidden + ["--attention-dropout", "0.1"]
    expected = run_distributed(parity_losses_and_norms, 1, dropout)[0]
    control = run_distributed(parity_losses_and_norms, 1, hidden)[0]
    assert _worst([control], expected, 0) > 10 * TOLERANCE  # dropout is on, and visible
    assert _worst([control], expected, 1) > 10 * TOLERANCE
    for comm in ("p2p", "all_gather", "a2a"):
        runs = run_distributed(parity_losses_and_norms, 2, dropout + CP2 + ["--cp-comm-type", comm])
        _assert_matches(runs, expected)
        print(f"\n{comm}: max relative difference, losses {_worst(runs, expected, 0):.1e}, "
              f"grad norms {_worst(runs, expected, 1):.1e}")  # fmt: skip


def _worst(runs, expected, which: int) -> float:
    """Max relative difference over ranks and iterations of losses (0) or grad norms (1)."""
    return max(
        abs(got - want) / abs(want)
        for run in runs
        for got, want in zip(run[which], expected[which])
    )


def test_learned_positions_with_context_parallelism_match_one_rank():
    """Learned absolute position embeddings index by the tokens' global positions."""
    expected = run_distributed(parity_losses_and_norms, 1, [])[0]
    _assert_matches(run_distributed(parity_losses_and_norms, 2, CP2), expected)


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["cp2-to-cp1", "cp1-to-cp2"])
def test_a_checkpoint_continues_at_another_context_parallel_size(first, then, tmp_path):
    """Layout-free checkpoints: 2 iterations at one CP size, saved, continued at the other,
    give the uninterrupted one-rank run's last 2 iterations (optimizer state included)."""
    expected = run_distributed(parity_losses_and_norms, 1, ROPE)[0]
    save = ["--save", str(tmp_path), "--save-interval", "2", "--exit-interval", "2"]
    cp = {1: [], 2: CP2}
    run_distributed(parity_losses_and_norms, first, ROPE + cp[first] + save)
    resumed = run_distributed(
        parity_losses_and_norms, then, ROPE + cp[then] + ["--load", str(tmp_path)]
    )
    losses, norms = expected
    for rank_losses, rank_norms in resumed:
        assert rank_losses == pytest.approx(losses[2:], rel=TOLERANCE)
        assert rank_norms == pytest.approx(norms[2:], rel=TOLERANCE)


def _losses_and_norms(rank: int, world_size: int, argv: list[str]):
    results, _ = train_with_flags(rank, world_size, argv)
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> list[str]:
    """Flags for a .bin/.idx of 3..12-token documents (NullTokenizer: the eod is id 200), so
    that every 16-token sample holds several documents, with --mock-data dropped."""
    directory = tmp_path_factory.mktemp("cp-documents")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(directory / "docs", np.uint16) as builder:
        for _ in range(400):
            builder.add_item([*rng.integers(0, 200, int(rng.integers(2, 12))), 200])
            builder.end_document()
    data = ["--data-path", str(directory / "docs"), "--tokenizer-type", "NullTokenizer",
            "--data-cache-path", str(directory / "cache")]  # fmt: skip
    return [f for f in PARITY_FLAGS if f != "--mock-data"] + data


DOCUMENT_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_document_masks_with_context_parallelism_match_one_rank(short_documents):
    """--reset-attention-mask (per-token document ids split with the tokens, attention within
    each document), --reset-position-ids (learned embeddings at per-document positions) and
    --eod-mask-loss under CP 2, each comm type, give the one-rank run's losses and norms."""
    flags = short_documents + DOCUMENT_FLAGS
    expected = run_distributed(_losses_and_norms, 1, flags)[0]
    for dropped in ("--reset-attention-mask", "--eod-mask-loss"):  # the documents are short
        control = run_distributed(_losses_and_norms, 1, [f for f in flags if f != dropped])[0]
        assert control[1] != pytest.approx(expected[1], rel=1e-3), dropped
    for comm in ("p2p", "all_gather", "a2a"):
        runs = run_distributed(_losses_and_norms, 2, flags + CP2 + ["--cp-comm-type", comm])
        _assert_matches(runs, expected)
