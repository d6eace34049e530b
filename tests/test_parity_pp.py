"""Pipeline parity: the executor's losses, gradients and grad norm match one rank, over steps.

Each rank builds its model chunks and the single-rank reference from the same seed, trains
both with Adam for a few steps on the same global batches, and compares losses (last stage),
every gradient shard of the first step, and the grad norm of every step (later steps' losses
and norms check the optimizer updates too). The tolerance is the tensor-parallel one (2e-5
relative). Weights are not compared after Adam steps: Adam turns fp32 noise in near-zero
gradients into full-size updates, so they differ by up to ~lr while losses agree to 1e-6.
"""

import pytest
import torch

from megapipe.testing import run_distributed
from tests.helpers import EMULATE, PARITY_TOLERANCE, check_pipeline_parity, pipeline_parity

torch.optim.Adam([torch.zeros(1)])  # first use imports torch._dynamo (~3 s): once, before forking

LAYOUTS = [  # tp, pp, v, schedule, tied, micro-batches
    (1, 2, 1, "1f1b", True, 4),
    (1, 2, 1, "1f1b", False, 3),
    (1, 4, 1, "1f1b", True, 6),
    (1, 4, 1, "1f1b", False, 2),  # fewer micro-batches than stages
    (1, 2, 1, "gpipe", True, 3),
    (1, 2, 2, "interleaved-1f1b", True, 4),
    (1, 2, 2, "interleaved-1f1b", False, 2),
    (1, 4, 2, "interleaved-1f1b", True, 4),
    (2, 2, 1, "1f1b", True, 4),
    (2, 2, 2, "interleaved-1f1b", False, 4),
]


@EMULATE
@pytest.mark.parametrize("tp,pp,v,kind,tied,m", LAYOUTS)
def test_pipeline_matches_single_rank(tp, pp, v, kind, tied, m, emulate):
    check_pipeline_parity(tp, pp, v, kind, tied, m, emulate=emulate)


@pytest.mark.parametrize(
    "tp,pp,v,kind,tied,m",
    [
        (1, 2, 1, "1f1b", True, 4),
        (1, 4, 1, "1f1b", False, 2),  # fewer micro-batches than stages
        (1, 4, 2, "interleaved-1f1b", True, 4),
        (2, 2, 2, "interleaved-1f1b", False, 4),
    ],
)
@EMULATE
def test_receives_posted_ahead_match_single_rank(tp, pp, v, kind, tied, m, emulate):
    check_pipeline_parity(tp, pp, v, kind, tied, m, post_ahead=True, emulate=emulate)


@EMULATE
def test_sequence_parallel_pipeline_matches_single_rank(emulate):
    results = run_distributed(
        pipeline_parity, 4, 2, 2, 1, "1f1b", True, 4, 2, sequence_parallel=True, emulate=emulate
    )
    for r in results:
        assert (
            r["loss"] < PARITY_TOLERANCE
            and r["norm"] < PARITY_TOLERANCE
            and r["grads"] < PARITY_TOLERANCE
        ), r


def _without_tied_embedding_sync(rank, world):
    from megapipe.distributed import finalize_grads

    finalize_grads.tied_embedding_grads = lambda chunks: []  # deliberately broken, this rank only
    return pipeline_parity(rank, world, 1, 2, 1, "1f1b", True, 4, 2)


def test_skipping_the_tied_embedding_all_reduce_fails_parity():
    first, last = run_distributed(_without_tied_embedding_sync, 2)
    assert max(first["grads"], last["grads"]) > 1000 * PARITY_TOLERANCE
    assert not torch.equal(first["shared"][0], last["shared"][0])


@EMULATE
def test_every_stage_reads_each_micro_batch_once_when_masks_need_it(emulate):
    """--reset-attention-mask: every chunk needs the batch; a rank still reads it once."""
    results = run_distributed(pipeline_parity, 2, 1, 2, 2, "interleaved-1f1b", True, 4, 1,
                              every_stage=True, emulate=emulate)  # fmt: skip
    for r in results:
        assert r["loss"] < PARITY_TOLERANCE and r["grads"] < PARITY_TOLERANCE, r
        assert sorted(r["reads"]) == [(0, i) for i in range(4)]
