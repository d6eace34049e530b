"""Run every rank's action list together, without processes, to prove a schedule sound.

`ordering="gloo"` (the default) is the executor's semantics on gloo (`executor.py`, `p2p.py`),
with rendezvous transfers, the strictest a transport can be: a `Comm` batch is posted without
waiting, after which the rank waits for the sends of its earlier batches, and a send completes
only once its peer has posted the matching receive (no buffering); a compute waits for the
receive it needs, whose data leaves when the peer posts the send; between two ranks sends and
receives must be posted in the same order (NCCL and gloo match point-to-point messages
first-in first-out); and at the end of the list the rank waits for its last sends. Its
timeline under a cost model (forward 1, backward 2 or, split, B 1 and W 1, transfers
`comm_cost` each) gives the bubble.

`ordering="nccl"` is the GPU's rule instead: NCCL runs a process group's transfers on one CUDA
stream in posting order, so each batch is split per group (`channel`, by default the link of
`schedules.p2p_link`) and queued on that group's stream; a sub-batch starts only when the one
before it on the stream has completed (a receive posted early holds back every later transfer
of its group), a transfer completes once both sides' sub-batches have started, and the host
never waits except for a compute's input (a stream wait on the GPU) and at the end of the list.
`--emulate-nccl-p2p-order` makes real gloo runs behave the same (`p2p.py`).

A forward-only (evaluation) schedule is checked the same way, expecting every forward and no
backward; its in-flight count is then the outputs computed but not yet posted downstream.
In training, a micro-batch is in flight on a chunk from its forward to its last backward pass
(B, or W where the schedule splits the backward): what the chunk keeps for it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from megapipe.errors import MegapipeError
from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    P2P,
    ZERO_BUBBLE_KINDS,
    Action,
    Comm,
    Compute,
    build_schedule,
    p2p_link,
    transfer_key,
)

Ordering = Literal["gloo", "nccl"]
ORDERINGS: tuple[Ordering, ...] = ("gloo", "nccl")


class ScheduleError(MegapipeError, RuntimeError):
    """The action lists deadlock, miss work, or compute before their inputs arrive."""


@dataclass(frozen=True)
class Interval:
    """One compute on one rank in simulated time."""

    rank: int
    action: Compute
    start: float
    end: float


@dataclass
class Simulation:
    """Timeline and statistics of one simulated step."""

    num_ranks: int
    intervals: list[Interval] = field(default_factory=list)
    peak_in_flight: list[int] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(i.end for i in self.intervals)

    def busy(self, rank: int) -> float:
        return sum(i.end - i.start for i in self.intervals if i.rank == rank)

    def idle(self, rank: int) -> float:
        return self.makespan - self.busy(rank)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle over ideal compute time: of `rank`, or the worst rank."""
        ranks = range(self.num_ranks) if rank is None else [rank]
        return max(self.idle(r) / self.busy(r) for r in ranks)


def simulate(
    schedules: Sequence[Sequence[Action]],
    num_microbatches: int,
    num_chunks: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    comm_cost: float = 0.0,
    forward_only: bool = False,
    weight_cost: float = 1.0,
    compute_cost: Callable[[int, Compute], float] | None = None,
    ordering: Ordering = "gloo",
    channel: Callable[[int, P2P], Hashable] = p2p_link,
) -> Simulation:
    """Execute all ranks' lists; raise ScheduleError on deadlock or incomplete work.

    forward_only: the lists must run every forward and no backward; `peak_in_flight` then
    counts outputs not yet sent (what an evaluation step holds), not micro-batches awaiting
    their backward. Lists with W computes must run one W after each B (weight_cost each).
    compute_cost(rank, compute): each compute's duration (e.g. measured ones, to replay a
    traced step), instead of the per-phase costs.
    ordering: "gloo" or "nccl" (see the module docstring); channel(rank, op): the process
    group (stream) that `op` of `rank` travels over under "nccl".
    """
    p = len(schedules)
    nccl = ordering == "nccl"
    pc = [0] * p
    clock = [0.0] * p
    queued: set[tuple] = set()  # (side, key) handed to p2p by the rank
    posted: dict[tuple, float] = {}  # (side, key) -> when it started (nccl: reached its stream)
    posted_batches: set[tuple[int, int]] = set()
    channel_order: dict[tuple, list] = {}  # (side, pair, group) -> transfer keys in post order
    # nccl: per rank and group, the sub-batches posted and not yet complete, oldest first
    streams: list[dict[Hashable, list[list[tuple]]]] = [{} for _ in range(p)]
    stream_free: dict[tuple[int, Hashable], float] = {}  # when its last sub-batch completed
    sends: list[list[tuple[P2P, tuple]]] = [[] for _ in range(p)]  # gloo: in flight, per rank
    done: list[set] = [set() for _ in range(p)]
    in_flight = [0] * p
    sim = Simulation(p, peak_in_flight=[0] * p)
    last_stage = p * num_chunks - 1
    split = any(isinstance(a, Compute) and a.phase == "W" for s in schedules for a in s)
    final_phase = "W" if split else "B"
    cost = {"F": forward_cost, "B": backward_cost, "W": weight_cost}

    def arrival(side_key: tuple) -> float | None:
        """When the transfer of one side completes: both sides started, plus its cost."""
        side, key = side_key
        partner = ("recv" if side == "send" else "send", key)
        if side_key not in posted or partner not in posted:
            return None
        return max(posted[side_key], posted[partner]) + comm_cost

    def advance_streams(rank: int) -> bool:
        """nccl: start each group's oldest sub-batch, retire it once all its transfers are
        done, and start the next one then; True if anything moved."""
        moved = False
        for group, batches in streams[rank].items():
            while batches:
                head = batches[0]
                if head[0] not in posted:  # starts when the one before it completed
                    at = max(posted_at[head[0]], stream_free.get((rank, group), 0.0))
                    posted.update((side_key, at) for side_key in head)
                    moved = True
                finished = [arrival(side_key) for side_key in head]
                if any(t is None for t in finished):
                    break
                stream_free[(rank, group)] = max(finished)
                batches.pop(0)
                moved = True
        return moved

    posted_at: dict[tuple, float] = {}  # nccl: when the host handed each transfer over

    def try_compute(rank: int, step: Compute) -> bool:
        stage = step.chunk * p + rank
        unit = (step.phase, step.microbatch, step.chunk)
        if forward_only and step.phase != "F":
            raise ScheduleError(f"rank {rank} runs {step} in a forward-only schedule")
        if unit in done[rank]:
            raise ScheduleError(f"rank {rank} runs {step} twice")
        needs = None
        if step.phase == "F":
            needs = ("F", step.microbatch, stage - 1, stage) if stage > 0 else None
        elif ("F" if step.phase == "B" else "B", *unit[1:]) not in done[rank]:
            before = "forward" if step.phase == "B" else "B"
            raise ScheduleError(f"rank {rank} runs {step} before its {before}")
        elif step.phase == "B":
            needs = ("B", step.microbatch, stage + 1, stage) if stage < last_stage else None
        start = clock[rank]
        duration = cost[step.phase] if compute_cost is None else compute_cost(rank, step)
        if needs is not None:
            if ("recv", needs) not in queued:
                raise ScheduleError(f"rank {rank} runs {step} before receiving its input")
            ready = arrival(("recv", needs))
            if ready is None:
                return False
            start = max(start, ready)
        sim.intervals.append(Interval(rank, step, start, start + duration))
        clock[rank] = start + duration
        done[rank].add(unit)
        if step.phase == "F":
            if not (forward_only and stage == last_stage):  # the last stage keeps only a loss
                in_flight[rank] += 1
                sim.peak_in_flight[rank] = max(sim.peak_in_flight[rank], in_flight[rank])
        elif step.phase == final_phase:
            in_flight[rank] -= 1
        return True

    def try_drain(rank: int, keep: int = 0) -> bool:
        """gloo: wait for this rank's sends in flight but the newest `keep` (just posted)."""
        older = sends[rank][: len(sends[rank]) - keep]
        finished = [arrival(("send", key)) for _, key in older]
        if any(t is None for t in finished):
            return False
        clock[rank] = max([clock[rank], *finished])
        del sends[rank][: len(older)]
        return True

    def try_comm(rank: int, batch: Comm) -> bool:
        """Post the batch (once); gloo: then wait for the sends of the rank's earlier batches.
        nccl: one sub-batch per group, each queued on its group's stream; the host goes on."""
        new_sends = sum(op.op == "send" for op in batch.ops)
        if (rank, pc[rank]) not in posted_batches:
            posted_batches.add((rank, pc[rank]))
            by_group: dict[Hashable, list[tuple]] = {}
            for op in batch.ops:
                side_key = (op.op, transfer_key(op, rank, p))
                if side_key in queued:
                    raise ScheduleError(f"rank {rank} posts {side_key} twice")
                queued.add(side_key)
                group = channel(rank, op) if nccl else None
                pair = (rank, op.peer) if op.op == "send" else (op.peer, rank)
                channel_order.setdefault((op.op, pair, group), []).append(side_key[1])
                if nccl:
                    posted_at[side_key] = clock[rank]
                    by_group.setdefault(group, []).append(side_key)
                else:
                    posted[side_key] = clock[rank]
                    if op.op == "send":
                        sends[rank].append((op, side_key[1]))
                if op.op == "send" and forward_only:  # the output is let go of once handed over
                    in_flight[rank] -= 1
            for group, sub_batch in by_group.items():
                streams[rank].setdefault(group, []).append(sub_batch)
        return nccl or try_drain(rank, keep=new_sends)

    def streams_idle(rank: int) -> bool:
        return not any(streams[rank].values())

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pc[rank] < len(schedules[rank]):
                if nccl and advance_streams(rank):
                    progress = True
                action = schedules[rank][pc[rank]]
                ran = (
                    try_compute(rank, action)
                    if isinstance(action, Compute)
                    else try_comm(rank, action)
                )
                if not ran:
                    break
                pc[rank] += 1
                progress = True
            if nccl and advance_streams(rank):
                progress = True
            if pc[rank] == len(schedules[rank]) and sends[rank] and try_drain(rank):
                progress = True

    stuck = [r for r in range(p) if pc[r] < len(schedules[r]) or sends[r] or not streams_idle(r)]
    if stuck:
        raise ScheduleError(
            "deadlock: " + "; ".join(_waiting(r, schedules, pc, sends, streams) for r in stuck)
        )
    if nccl:  # a rank's step ends when its streams are idle
        for rank in range(p):
            clock[rank] = max([clock[rank], *(t for (r, _), t in stream_free.items() if r == rank)])
    for (side, pair, group), order in channel_order.items():
        if side == "send" and order != channel_order.get(("recv", pair, group)):
            raise ScheduleError(
                f"ranks {pair[0]} -> {pair[1]} post sends and receives in different orders; "
                "FIFO matching would swap tensors"
            )
    phases = "F" if forward_only else ("FBW" if split else "FB")
    expected = {
        (ph, i, c) for ph in phases for i in range(num_microbatches) for c in range(num_chunks)
    }
    for rank in range(p):
        if done[rank] != expected:
            missing = sorted(expected - done[rank])
            raise ScheduleError(f"rank {rank} never runs {missing[:4]}")
    return sim


def _waiting(rank: int, schedules, pc: list[int], sends, streams) -> str:
    """What a stuck rank waits for, for the deadlock message."""
    where = str(schedules[rank][pc[rank]]) if pc[rank] < len(schedules[rank]) else "its end"
    action = schedules[rank][pc[rank]] if pc[rank] < len(schedules[rank]) else None
    blocked = [
        f"{group} stream blocked in " + " ".join(f"{side}-{key}" for side, key in batches[0])
        for group, batches in streams[rank].items()
        if batches
    ]
    behind = f"; its {', '.join(blocked)}" if blocked else ""
    if isinstance(action, Compute):
        return f"rank {rank} waits in {where} (for its input{behind})"
    if not sends[rank]:
        return f"rank {rank} waits in {where}{behind}"
    unsent = " ".join(str(op) for op, _ in sends[rank])
    return f"rank {rank} waits in {where} (for its {unsent} to be received)"


def simulate_kind(
    kind: str,
    p: int,
    v: int,
    m: int,
    *,
    post_ahead: bool = False,
    ordering: Ordering = "gloo",
    **costs: float,
) -> Simulation:
    """Build every rank's schedule of `kind` and simulate them together.

    Per-chunk costs default to 1/v forward and 2/v backward (split: B 1/v and W 1/v, the
    paper's F = B = W), so a rank's work per micro-batch is 1 + 2 whatever v, and bubble
    fractions compare across schedules. post_ahead: see `build_schedule`; ordering: see
    `simulate`.
    """
    split = kind in ZERO_BUBBLE_KINDS
    costs.setdefault("forward_cost", 1.0 / v)
    costs.setdefault("backward_cost", (1.0 if split else 2.0) / v)
    costs.setdefault("weight_cost", 1.0 / v)
    schedules = [build_schedule(kind, p, v, m, r, post_ahead=post_ahead) for r in range(p)]
    return simulate(schedules, m, v, forward_only=kind == FORWARD_ONLY, ordering=ordering, **costs)


def replay(
    kind: str,
    p: int,
    v: int,
    m: int,
    durations: Mapping[tuple[int, Compute], float],
    *,
    post_ahead: bool = False,
) -> Simulation:
    """Schedule `kind` with each compute taking its measured duration, `durations[(rank,
    compute)]`, and free transfers: what a traced step would have taken had communication
    and the executor cost nothing. KeyError names a compute the durations lack."""

    def duration(rank: int, compute: Compute) -> float:
        if (rank, compute) not in durations:
            raise KeyError(f"no measured duration of {compute} on rank {rank}")
        return durations[(rank, compute)]

    schedules = [build_schedule(kind, p, v, m, r, post_ahead=post_ahead) for r in range(p)]
    return simulate(schedules, m, v, compute_cost=duration)
