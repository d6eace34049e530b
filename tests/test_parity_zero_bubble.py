"""Zero-bubble schedules: the same losses, gradients and grad norms as one rank, W included.

The executor-level cases reuse test_parity_pp's check (tests/helpers.py: three Adam steps against a
single-rank GPT, every gradient shard of the first step, the grad norm of every step, the
simulator's stash count). The whole-stack cases run the product's training step (grad buffers
with overlapped bucket reduction, the distributed optimizer, clipping) at TP2 x PP2 x DP2 with
tied embeddings against the one-rank run. And one case checks the grad buffers directly: with
deferred weight gradients, every bucket still starts its reduction during the step (after its
last W, or the buffer would refuse the late gradient), and the reduced gradients are
bit-identical to 1F1B's.
"""

from __future__ import annotations

import pytest
import torch

from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import build_schedule
from megapipe.testing import run_distributed
from tests.helpers import (
    EMULATE,
    PARITY_MICRO_BATCH,
    PARITY_SEED,
    check_pipeline_parity,
    parity_config,
    parity_losses_and_norms,
    parity_micro_batch,
)

torch.optim.Adam([torch.zeros(1)])  # first use imports torch._dynamo (~3 s): once, before forking

# Within the 60 s of CI these tests may take; (1, 4, 1, zero-bubble-h1, untied, 6) and
# (1, 4, 2, interleaved-zero-bubble, untied, 4) pass too (8 s and 19 s more).
LAYOUTS = [  # tp, pp, v, schedule, tied, micro-batches
    (1, 2, 1, "zero-bubble-h1", True, 4),
    (1, 4, 1, "zero-bubble-h1", True, 2),  # fewer micro-batches than stages
    (2, 2, 1, "zero-bubble-h1", True, 4),
    (1, 2, 2, "interleaved-zero-bubble", False, 4),
]


@EMULATE
@pytest.mark.parametrize("tp,pp,v,kind,tied,m", LAYOUTS)
def test_zero_bubble_pipeline_matches_single_rank(tp, pp, v, kind, tied, m, emulate):
    check_pipeline_parity(tp, pp, v, kind, tied, m, emulate=emulate)


@EMULATE
@pytest.mark.parametrize("kind,v", [("zero-bubble-h1", 1), ("interleaved-zero-bubble", 2)])
def test_zero_bubble_with_receives_posted_ahead_matches_single_rank(kind, v, emulate):
    check_pipeline_parity(1, 2, v, kind, True, 4, post_ahead=True, emulate=emulate)


_train = parity_losses_and_norms


STACK = {
    "zb-h1-tp2-pp2-dp2": (
        8,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "zero-bubble-h1",
            "--emulate-nccl-p2p-order",  # the p2p transfers in NCCL's order, as on GPUs
        ],
    ),
}  # fmt: skip  (interleaved-zero-bubble at PP2 x VP2 x DP2 passes too: 20 s more)


@pytest.mark.parametrize("layout", sorted(STACK))
def test_the_training_step_with_zero_bubble_matches_one_rank(layout):
    world, extra = STACK[layout]
    extra = extra + ["--overlap-grad-reduce", "--use-distributed-optimizer"]
    losses, norms = run_distributed(_train, 1, [])[0]
    for rank_losses, rank_norms in run_distributed(_train, world, extra):
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        assert rank_norms == pytest.approx(norms, rel=1e-5)
    assert norms[0] > 0.5  # clipping was active in the first step


def _buffered_step(rank: int, world: int, kind: str):
    config = parity_config(4, tied=True)
    state = ParallelState.build(1, 2)  # PP2 x DP2
    chunks = build_model_chunks(
        config,
        state,
        RNGTracker(PARITY_SEED, 0, state.pp_rank),
        partition_layers(config, 2, 1),
        seed=PARITY_SEED,
    )
    m = 4
    buffer = GradBuffer(
        list(chunks[0].parameters()),
        state.dp,
        num_microbatches=m,
        bucket_size=2000,
        overlap=True,
        solo=[p for p in [chunks[0].shared_word_embedding()] if p is not None],
    )
    executor = PipelineExecutor(
        chunks,
        state,
        build_schedule(kind, 2, 1, m, state.pp_rank),
        num_microbatches=m,
        activation_shape=activation_shape(config, PARITY_MICRO_BATCH, 1, False),
    )
    executor.run(lambda i: parity_micro_batch(config, state.dp_rank, i))
    started = buffer.started_before_finish
    buffer.finish_grad_sync()
    return started, len(buffer.buckets), buffer.grad_data.clone()


def test_deferred_weight_gradients_reach_the_overlapped_buckets_in_the_step():
    one_f_one_b = run_distributed(_buffered_step, 4, "1f1b")
    zero_bubble = run_distributed(_buffered_step, 4, "zero-bubble-h1")
    for (_, _, grads), (started, buckets, zb_grads) in zip(one_f_one_b, zero_bubble):
        assert buckets >= 3 and started == buckets  # all overlapped, none left to the sync
        assert torch.equal(grads, zb_grads)


def _one_rank_executor(actions):
    config = parity_config(2, tied=True)
    state = ParallelState.single()
    chunks = build_model_chunks(
        config, state, RNGTracker(PARITY_SEED), partition_layers(config, 1, 1), seed=PARITY_SEED
    )
    return config, PipelineExecutor(
        chunks,
        state,
        actions,
        num_microbatches=2,
        activation_shape=activation_shape(config, PARITY_MICRO_BATCH, 1, False),
    )


def test_a_schedule_that_drops_or_reorders_a_w_is_refused():
    actions = build_schedule("zero-bubble-h1", 1, 1, 2, 0)
    assert [str(a) for a in actions] == ["F0", "B0", "W0", "F1", "B1", "W1"]
    config, executor = _one_rank_executor(actions[:-1])
    with pytest.raises(RuntimeError, match="1 backward passes' deferred weight gradients"):
        executor.run(lambda i: parity_micro_batch(config, 0, i))
    swapped = actions[:2] + actions[3:5] + [actions[5], actions[2]]  # W1 before W0
    config, executor = _one_rank_executor(swapped)
    with pytest.raises(RuntimeError, match=r"runs W1 but the oldest pending B is \(0, 0\)"):
        executor.run(lambda i: parity_micro_batch(config, 0, i))


def test_a_w_tells_the_watchdog_what_it_runs(monkeypatch):
    """A rank stuck in a W (its SP all-gather, say) is reported as in its weight gradients,
    not in the B before it."""
    config, executor = _one_rank_executor(build_schedule("zero-bubble-h1", 1, 1, 2, 0))
    seen = []
    store = executor.weight_grad_stores[0]
    compute = store.compute_weight_grads

    def recording(*args, **kwargs):
        seen.append((executor.comm.activity.current[0], executor.comm.activity.operation()))
        return compute(*args, **kwargs)

    monkeypatch.setattr(store, "compute_weight_grads", recording)
    executor.run(lambda i: parity_micro_batch(config, 0, i))
    assert seen == [
        ("weight-grad", f"weight gradients of micro-batch {i} (model chunk 0)") for i in (0, 1)
    ]
