"""NCCL's rules emulated on real gloo ranks (`parallel/emulated_stream.NcclEmulation`): each rule
alone hangs what it must, and megapipe's posting completes under both.

The driver posts every rank's schedule as the pipeline's p2p does (each batch one group call
per communicator; a compute waits for its input's receive), with one-element tensors tagged by
their transfer so that gloo pairs each send with its own receive. 1F1B at PP=2 as megapipe
posted it before (a communicator per direction between two stages, every receive one unit
early) runs with a stream per communicator and hangs under the handshake rule alone and under
one queue alone, as the simulator says (tests/test_nccl_ordering.py); the posting now, with
its start-up connections, runs under both. The one-queue rule also puts collectives behind the
transfers queued before them. Real runs of every schedule at PP=2 and PP=4 complete under both
rules (posted ahead, the default) with plain gloo's losses.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megapipe.config import NCCL_RULES, ModelConfig
from megapipe.data.batch import TrainingBatch
from megapipe.parallel.emulated_stream import NcclEmulation, emulation_rules
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    Comm,
    build_schedule,
    connect_schedule,
    p2p_channel,
    transfer_key,
)
from megapipe.testing import run_distributed
from megapipe.testing.posting_before import link_channel, receives_one_unit_early

TIMEOUT_S = 2.0
P, M = 2, 4
KINDS_V = [("gpipe", 1), ("1f1b", 1), ("zero-bubble-h1", 1), ("interleaved-1f1b", 2),
           ("interleaved-zero-bubble", 2), (FORWARD_ONLY, 1), (FORWARD_ONLY, 2)]  # fmt: skip


def _tag(key: tuple[str, int, int, int]) -> int:
    phase, microbatch, src, dst = key
    return (((phase == "B") * 64 + microbatch + 1) * 16 + src) * 16 + dst


def _input_of(step, rank: int, p: int, v: int):
    stage, last = step.chunk * p + rank, p * v - 1
    if step.phase == "F" and stage > 0:
        return ("F", step.microbatch, stage - 1, stage)
    if step.phase == "B" and stage < last:
        return ("B", step.microbatch, stage + 1, stage)
    return None


def _drive(rank: int, world: int, rules: tuple[str, ...], posting: str, v: int = 1) -> str:
    """Run `posting` ("before" or "now") of 1F1B (or interleaved with v > 1) under `rules`;
    "ok", or the first line of the error that ended it."""
    emulation = NcclEmulation(rules, timedelta(seconds=TIMEOUT_S))
    kind = "1f1b" if v == 1 else "interleaved-1f1b"
    if posting == "before":
        actions, channel = receives_one_unit_early(kind, P, v, M, rank), link_channel
    else:
        actions = connect_schedule(P, v, rank)
        actions += build_schedule(kind, P, v, M, rank, post_ahead=True)
        channel = p2p_channel
    posted = {}
    try:
        for action in actions:
            if isinstance(action, Comm):
                calls: dict = {}
                for op in action.ops:
                    calls.setdefault(channel(rank, op), []).append(op)
                for communicator, ops in calls.items():
                    keys = [(op.op, transfer_key(op, rank, P)) for op in ops]
                    p2p = [
                        dist.P2POp(dist.isend if op.op == "send" else dist.irecv, torch.zeros(1),
                                   op.peer, tag=_tag(key))
                        for op, (_, key) in zip(ops, keys)
                    ]  # fmt: skip
                    batch = emulation.submit(str(communicator), {op.peer for op in ops}, p2p)
                    posted.update(dict.fromkeys(keys, batch))
            else:
                need = _input_of(action, rank, P, v)
                if need is not None:
                    posted[("recv", need)].wait(emulation.timeout)
        for batch in posted.values():
            batch.wait(emulation.timeout)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "ok"


def test_the_posting_before_runs_with_a_stream_per_communicator():
    assert run_distributed(_drive, 2, ("streams",), "before", timeout=30) == ["ok", "ok"]


@pytest.mark.parametrize("rule", ["handshake", "one-queue"])
def test_each_rule_alone_hangs_the_posting_before(rule):
    results = run_distributed(_drive, 2, (rule,), "before", timeout=30)
    assert all(r != "ok" for r in results), results
    if rule == "handshake":  # each rank's first call waits for a peer whose first is elsewhere
        assert all("connection handshake" in r for r in results), results


@pytest.mark.parametrize("v", [1, 2])
def test_the_posting_now_runs_under_both_rules(v):
    rules = tuple(sorted(emulation_rules(True)))
    assert run_distributed(_drive, 2, rules, "now", v, timeout=30) == ["ok", "ok"]


def _collective_behind_a_receive(rank: int, world: int, rules: tuple[str, ...]) -> str:
    """Rank 0 queues a receive, then all-reduces; rank 1 sends only after the all-reduce."""
    emulation = NcclEmulation(rules, timedelta(seconds=TIMEOUT_S))
    total = torch.ones(1)
    try:
        with emulation.collectives_behind_queue():
            if rank == 0:
                got = torch.zeros(1)
                batch = emulation.submit("pp", [1], [dist.P2POp(dist.irecv, got, 1)])
                dist.all_reduce(total, async_op=True).wait(timedelta(seconds=3 * TIMEOUT_S))
                batch.wait(emulation.timeout)
                assert float(got) == 7.0
            else:
                dist.all_reduce(total, async_op=True).wait(timedelta(seconds=3 * TIMEOUT_S))
                emulation.submit("pp", [0], [dist.P2POp(dist.isend, torch.full((1,), 7.0), 0)])
                emulation.drain()
    except RuntimeError as error:
        return "error: " + str(error).splitlines()[0]
    return f"ok {float(total):g}"


def test_one_queue_puts_a_collective_behind_the_receive_queued_before_it():
    # a stream per communicator: the all-reduce runs beside the pending receive
    assert run_distributed(_collective_behind_a_receive, 2, ("streams",)) == ["ok 2", "ok 2"]
    # one queue: rank 0's all-reduce waits for its receive, whose send waits for the all-reduce
    first, second = run_distributed(_collective_behind_a_receive, 2, ("one-queue",), timeout=30)
    assert first.startswith("error: the emulated NCCL stream did not reach"), first
    assert second.startswith("error"), second


def _every_schedule(rank: int, world: int) -> dict:
    """One step of every schedule (and the forward-only one) on `world` pipeline ranks, posted
    ahead (the default; the simulator proves the late posting too), under both rules and on
    plain gloo; the last stage's losses of each."""
    state = ParallelState.build(1, world)
    losses = {}
    for kind, v in KINDS_V:
        config = ModelConfig(num_layers=world * v, hidden_size=16, num_attention_heads=2,
                             vocab_size=64, seq_length=8, attention_dropout=0.0,
                             hidden_dropout=0.0)  # fmt: skip
        chunks = build_model_chunks(config, state, RNGTracker(1, 0, state.pp_rank),
                                    partition_layers(config, world, v), seed=1)  # fmt: skip
        m, stores = 2 * world, None  # a zero-bubble chunk's layers defer into one store
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 64, (m, 2, 9), generator=gen)

        def batch(i: int, tokens: torch.Tensor = tokens) -> TrainingBatch:
            return TrainingBatch(tokens[i, :, :-1], tokens[i, :, 1:], torch.ones(2, 8))

        for emulate in ((), NCCL_RULES):
            actions = build_schedule(kind, world, v, m, state.pp_rank, post_ahead=True)
            executor = PipelineExecutor(
                chunks, state, actions, num_microbatches=m,
                activation_shape=activation_shape(config, 2, 1, False),
                comm=P2PCommunicator(state, timeout_s=20, emulate_nccl_order=emulate),
                weight_grad_stores=stores,
            )  # fmt: skip
            stores = executor.weight_grad_stores or None
            step = executor.run(batch)
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            losses[(kind, v, bool(emulate))] = [float(x) for x in step]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_runs_under_both_rules_on_real_ranks(pp):
    last = run_distributed(_every_schedule, pp, timeout=300)[-1]
    for (kind, v, emulated), losses in last.items():
        assert len(losses) == 2 * pp, (kind, v)
        if emulated:  # the same numbers as plain gloo's
            assert losses == last[(kind, v, False)], (kind, v)
