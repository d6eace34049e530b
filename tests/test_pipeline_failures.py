"""A stage whose neighbour stops answering fails with an error naming that neighbour, in time.

One rank of a 2-rank pipeline runs the executor with a 2 s p2p timeout; its peer either never
posts its side of the first transfer (the start-up connection's token exchange), or runs part
of the step and then stops (as a rank that died mid-step would; it returns instead of dying so
that the harness collects both ranks' results). Gloo's rendezvous semantics make both
directions observable: a receive waits for the peer's send, and a send of an unbound buffer
waits for the peer's matching receive.
"""

from __future__ import annotations

import time

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.data.batch import TrainingBatch
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator, PipelineCommError
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import build_schedule
from megapipe.testing import run_distributed
from megapipe.testing.posting_before import receives_one_unit_early

TIMEOUT_S = 2.0
SILENCE_S = TIMEOUT_S + 1.0  # the silent peer outlives the timeout, so it is a timeout we see
M = 4
CONFIG = ModelConfig(
    num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8
)


class PeerStopped(RuntimeError):
    """Raised inside the stopping rank's executor to end its step early."""


def _batch(microbatch: int, stop_at: int | None) -> TrainingBatch:
    if microbatch == stop_at:
        raise PeerStopped(f"stopped at micro-batch {microbatch}")
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1))
    return TrainingBatch(tokens[:, :-1], tokens[:, 1:], torch.ones(2, CONFIG.seq_length))


def _executor(
    state: ParallelState, *, post_ahead: bool = False, emulate: bool = False
) -> PipelineExecutor:
    chunks = build_model_chunks(
        CONFIG, state, RNGTracker(1, 0, state.pp_rank), partition_layers(CONFIG, 2, 1), seed=1
    )
    return PipelineExecutor(
        chunks,
        state,
        build_schedule("1f1b", 2, 1, M, state.pp_rank, post_ahead=post_ahead),
        num_microbatches=M,
        activation_shape=activation_shape(CONFIG, 2, 1, False),
        comm=P2PCommunicator(state, timeout_s=TIMEOUT_S, emulate_nccl_order=emulate),
    )


def _timed_step(executor: PipelineExecutor) -> tuple[str, float]:
    """(the PipelineCommError's message or "no error", seconds the step took)."""
    start = time.monotonic()
    try:
        executor.run(lambda i: _batch(i, None))
    except PipelineCommError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


def _run(rank: int, world_size: int, watcher: int, peer_stops_at: int | None):
    """`watcher` runs the step; the other rank is silent (None) or stops at a micro-batch."""
    state = ParallelState.build(1, 2)
    if rank != watcher:
        if peer_stops_at is not None:
            executor = _executor(state)
            with pytest.raises(PeerStopped):
                executor.run(lambda i: _batch(i, peer_stops_at))
        time.sleep(SILENCE_S)
        return None
    return _timed_step(_executor(state))


@pytest.mark.parametrize(
    "watcher,peer_stops_at,expected",
    [
        (0, None, "receive from pipeline rank 1 (global rank 1) of the start-up connection"),
        (1, None, "receive from pipeline rank 0 (global rank 0) of the start-up connection"),
        (0, 1, "receive from pipeline rank 1"),  # the last stage stops at micro-batch 1
    ],
    ids=["silent-last-stage", "silent-first-stage", "last-stage-stops-mid-step"],
)
def test_a_silent_peer_times_out_with_its_name(watcher, peer_stops_at, expected) -> None:
    results = run_distributed(_run, 2, watcher, peer_stops_at, timeout=30)
    message, elapsed = results[watcher]
    assert expected in message, message
    assert f"after {TIMEOUT_S:.0f} s" in message
    assert TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + 1.0  # within the timeout, not the harness's


def _one_group_run(rank: int, world_size: int, emulate: bool):
    """1F1B with every receive posted one unit early over the pipeline group (how megapipe
    posted before it relied only on what NCCL promises): fine on gloo, a hang under NCCL's
    rules."""
    state = ParallelState.build(1, 2)
    executor = _executor(state, emulate=emulate)
    executor.actions = receives_one_unit_early("1f1b", 2, 1, M, state.pp_rank)
    return _timed_step(executor)


def test_nccl_order_emulation_hangs_where_gpus_would_and_names_the_peer() -> None:
    # gloo completes the transfers independently: the step runs
    assert [message for message, _ in run_distributed(_one_group_run, 2, False)] == ["no error"] * 2
    # emulated, rank 0's receive of B0's gradient, posted ahead with its send of F0, holds back
    # its send of F1 on the one stream; rank 1 needs F1 before it sends that gradient
    (first, elapsed), (second, _) = run_distributed(_one_group_run, 2, True, timeout=30)
    assert "receive from pipeline rank 1 (global rank 1) of B0.0" in first, first
    assert "receive from pipeline rank 0 (global rank 0) of F1.0" in second, second
    assert TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + 1.0
