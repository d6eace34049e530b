"""Parity with dropout on: TP2+SP, PP2 and TP2xPP2xDP2 train to the single rank's numbers.

Dropout masks are keyed by (seed, global sample, layer, site) and drawn over the logical tensor
(megapipe/model/dropout.py), so every layout drops the same activations as one rank does. The
training product runs with 0.1 attention and 0.1 hidden dropout, Adam and active clipping; the
losses and grad norms of every iteration must match the one-rank run to 1e-5 relative (the
fp32 tolerance of the dropout-free parity tests). Measured worst relative errors (CPU):
losses 9.2e-8 (TP2+SP), 0 (PP2), 9.0e-8 (TP2xPP2xDP2), 9.2e-8 (TP2+SP with rope, RMSNorm,
SwiGLU, GQA, untied); grad norms 1.2e-7, 6.5e-9, 1.4e-7, 9.3e-8.

Two controls keep the test honest: the dropout run's losses differ from the dropout-free
run's (by 2.2e-3: dropout really is on), and a TP2+SP run whose executor does not pass the
sample ids (so dropout falls back to per-rank random streams) misses the single-rank losses
(by 1.9e-3), far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)

from megapipe.testing import run_distributed, train_with_flags

TOLERANCE = 1e-5
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "200",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3",
    "--log-interval", "100", "--clip-grad", "0.5", "--weight-decay", "0.1",
]  # fmt: skip
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2"]  # fmt: skip
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # name: (architecture flags, world size, layout flags)
    "tp2-sp": ([], 2, TP2_SP),
    "pp2": ([], 2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-nccl-order": ([], 2, ["--pipeline-model-parallel-size", "2", "--emulate-nccl-p2p-order"]),
    "tp2-pp2-dp2": ([], 8, TP2_SP + ["--pipeline-model-parallel-size", "2"]),
    "llama-tp2-sp": (LLAMA, 2, TP2_SP),  # GQA heads and rotary under TP, untied output
}


def _train(rank: int, world_size: int, extra: list[str]):
    results, _ = train_with_flags(rank, world_size, BASE + extra)
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


def _train_without_sample_ids(rank: int, world_size: int, extra: list[str]):
    """The same run with the executor dropping the sample ids (patched in this rank only)."""
    from megapipe.pipeline.executor import PipelineExecutor

    run = PipelineExecutor.run
    PipelineExecutor.run = lambda self, get_batch, sample_ids=None, **kw: run(self, get_batch, **kw)
    return _train(rank, world_size, extra)


def worst_relative_error(actual: list[float], expected: list[float]) -> float:
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))


_REFERENCES: dict[tuple[str, ...], tuple[list[float], list[float]]] = {}


def reference(arch: list[str]) -> tuple[list[float], list[float]]:
    """The single-rank run with dropout, once per architecture."""
    if tuple(arch) not in _REFERENCES:
        _REFERENCES[tuple(arch)] = run_distributed(_train, 1, arch + DROPOUT)[0]
    return _REFERENCES[tuple(arch)]


def test_dropout_changes_the_single_rank_run():
    losses, _ = run_distributed(_train, 1, NO_DROPOUT)[0]
    assert worst_relative_error(losses, reference([])[0]) > 100 * TOLERANCE


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_with_dropout_match_one_rank(layout):
    arch, world, extra = LAYOUTS[layout]
    losses, norms = reference(arch)
    assert norms[0] > 0.5  # clipping was active in the first step
    for rank_losses, rank_norms in run_distributed(_train, world, arch + extra + DROPOUT):
        assert worst_relative_error(rank_losses, losses) < TOLERANCE, (rank_losses, losses)
        assert worst_relative_error(rank_norms, norms) < TOLERANCE, (rank_norms, norms)


def test_per_rank_streams_do_not_match_one_rank():
    losses, _ = reference([])
    for rank_losses, _ in run_distributed(_train_without_sample_ids, 2, TP2_SP + DROPOUT):
        assert worst_relative_error(rank_losses, losses) > 10 * TOLERANCE
