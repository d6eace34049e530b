"""Context parallelism trains to the one-rank run: losses and grad norms within 1e-5.

Each layout runs `pretrain_gpt.py`'s own path (train_with_flags) with rotary embeddings, fp32
and dropout off on the same global batches as the one-rank reference: every CP rank keeps its
two chunks of each sequence (global positions), attention runs over the CP group, the loss is
the mean over every CP rank's tokens, and gradients are averaged over DP x CP.
"""

from __future__ import annotations

import pytest

from megapipe.testing import run_distributed
from tests.helpers import parity_losses_and_norms

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
