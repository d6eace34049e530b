"""Data-parallel parity, the whole cube: Adam + clipping give the single rank's losses and norms.

Every layout runs the product's own training step (gradient buckets, the optimizer, the pipeline
executor) on the same global batches; losses and grad norms of every iteration must match the
one-rank run to 1e-5 relative (measured: ~1e-7). Small buckets force several buckets per chunk.
"""

from __future__ import annotations

import pytest
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)

from megapipe.testing import run_distributed, train_with_flags

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "200",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "100",
    "--clip-grad", "0.5", "--weight-decay", "0.1", "--ddp-bucket-size", "3000",
]  # fmt: skip


def _train(rank: int, world_size: int, extra: list[str]):
    results, _ = train_with_flags(rank, world_size, BASE + extra)
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train, 1, [])[0]


OPTIONS = {
    "plain": [],
    "overlap": ["--overlap-grad-reduce"],
    "distopt": ["--use-distributed-optimizer"],
    "distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}
LAYOUTS = {
    "dp2": (2, []),
    "dp4": (4, []),
    "tp2-pp2-dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                        "2", "--sequence-parallel"]),
}  # fmt: skip


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_data_parallel_layouts_match_one_rank(reference, layout, option):
    world, extra = LAYOUTS[layout]
    losses, norms = reference
    for rank_losses, rank_norms in run_distributed(_train, world, extra + OPTIONS[option]):
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        assert rank_norms == pytest.approx(norms, rel=1e-5)
    assert norms[0] > 0.5  # clipping was active in the first step
