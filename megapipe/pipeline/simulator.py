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

`ordering="nccl"` is the GPU's rule instead: each batch is split per communicator (`channel`,
by default `schedules.p2p_channel`), and each part is one NCCL group call queued on a CUDA
stream; a group call starts only when the one before it on its queue has completed (a receive
posted early holds back every later transfer queued behind it), a transfer completes once both
sides' group calls have started (a send may wait for its receive), and the host never waits
except for a compute's input (a stream wait on the GPU), at the end of the list, and in a
handshake. Two rules say how little NCCL and CUDA promise (nvidia/nccl#783, pytorch#113281),
each an option:

- `handshake=True`, lazy connections: a rank's first group call with a peer on a communicator
  blocks its host (inside `ncclGroupEnd`) until the peer's host reaches its own first group
  call with this rank there. A warm-up that connects every pair before the first step
  (`p2p.P2PCommunicator.connect`) is `handshake=False`.
- `queue="rank"`, one queue per rank: every communicator's group calls of a rank run in one
  posting order (CUDA does not promise that two streams progress together, and
  `CUDA_DEVICE_MAX_CONNECTIONS=1` funnels them into one hardware queue), instead of
  `queue="communicator"`, a stream per communicator that progresses on its own.

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
    INTERLEAVED_KINDS,
    P2P,
    SCHEDULE_KINDS,
    ZERO_BUBBLE_KINDS,
    Action,
    Comm,
    Compute,
    build_schedule,
    p2p_channel,
    transfer_key,
)

Ordering = Literal["gloo", "nccl"]
Queue = Literal["communicator", "rank"]


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
    channel: Callable[[int, P2P], Hashable] = p2p_channel,
    handshake: bool = False,
    queue: Queue = "communicator",
) -> Simulation:
    """Execute all ranks' lists; raise ScheduleError on deadlock or incomplete work.

    forward_only: the lists must run every forward and no backward; `peak_in_flight` then
    counts outputs not yet sent (what an evaluation step holds), not micro-batches awaiting
    their backward. Lists with W computes must run one W after each B (weight_cost each).
    compute_cost(rank, compute): each compute's duration (e.g. measured ones, to replay a
    traced step), instead of the per-phase costs.
    ordering: "gloo" or "nccl" (see the module docstring); channel(rank, op): the
    communicator (process group) that `op` of `rank` travels over under "nccl"; handshake,
    queue: NCCL's lazy connections and one queue per rank (the module docstring), "nccl" only.
    """
    costs = {"F": forward_cost, "B": backward_cost, "W": weight_cost}
    if compute_cost is None:
        compute_cost = lambda rank, step: costs[step.phase]  # noqa: E731
    nccl = _NcclRules(channel, handshake, queue) if ordering == "nccl" else None
    run = _Run(schedules, num_chunks, comm_cost, forward_only, compute_cost, nccl)
    run.execute()
    run.check(num_microbatches, num_chunks)
    return run.sim


@dataclass(frozen=True)
class _NcclRules:
    """What "nccl" ordering assumes: the communicator of each transfer, and the two rules."""

    channel: Callable[[int, P2P], Hashable]
    handshake: bool
    queue: Queue

    def queue_of(self, group: Hashable) -> Hashable:
        """The queue a group call of `group` waits in: its own stream, or the rank's one."""
        return group if self.queue == "communicator" else "queue"


class _Run:
    """The state of one simulation: every rank's position in its list, clock and transfers.

    A transfer is keyed by its side and `transfer_key` ((side, key) below). `queued`: handed
    to p2p by its rank; `started`: when it can move (gloo: when posted; nccl: when its group
    call reached the head of its queue). A transfer completes (`arrival`) once both sides have
    started, plus the transfer's cost.
    """

    def __init__(
        self,
        schedules: Sequence[Sequence[Action]],
        num_chunks: int,
        comm_cost: float,
        forward_only: bool,
        compute_cost: Callable[[int, Compute], float],
        nccl: _NcclRules | None,
    ) -> None:
        p = len(schedules)
        self.schedules, self.p = schedules, p
        self.comm_cost, self.forward_only, self.compute_cost = comm_cost, forward_only, compute_cost
        self.nccl = nccl
        self.pc = [0] * p
        self.clock = [0.0] * p
        self.queued: set[tuple] = set()
        self.started: dict[tuple, float] = {}
        self.order: dict[tuple, list] = {}  # (side, pair, group) -> transfer keys in post order
        self.handed_over: dict[tuple, float] = {}  # nccl: when the host queued each transfer
        # nccl: the group calls of the current batch handed over so far, per rank
        self.calls_done = [0] * p
        # nccl, handshake: (group, rank, peer) -> when rank's host reached its first call there
        self.arrived: dict[tuple[Hashable, int, int], float] = {}
        # nccl: per rank and queue, the group calls posted and not yet complete, oldest first
        self.streams: list[dict[Hashable, list[list[tuple]]]] = [{} for _ in range(p)]
        self.stream_free: dict[tuple[int, Hashable], float] = {}  # its last call's end
        self.sends: list[list[tuple[P2P, tuple]]] = [[] for _ in range(p)]  # gloo: in flight
        self.posted_batches: set[tuple[int, int]] = set()  # gloo
        self.done: list[set] = [set() for _ in range(p)]
        self.in_flight = [0] * p
        self.sim = Simulation(p, peak_in_flight=[0] * p)
        self.last_stage = p * num_chunks - 1
        split = any(isinstance(a, Compute) and a.phase == "W" for s in schedules for a in s)
        self.phases = "F" if forward_only else ("FBW" if split else "FB")
        self.final_phase = "W" if split else "B"

    def arrival(self, side_key: tuple) -> float | None:
        """When the transfer of one side completes, or None while it cannot."""
        side, key = side_key
        partner = ("recv" if side == "send" else "send", key)
        if side_key not in self.started or partner not in self.started:
            return None
        return max(self.started[side_key], self.started[partner]) + self.comm_cost

    def execute(self) -> None:
        """Advance every rank as far as it can, until nothing moves; raise on a deadlock."""
        progress = True
        while progress:
            progress = False
            for rank in range(self.p):
                progress |= self._advance(rank)
        stuck = [
            r
            for r in range(self.p)
            if self.pc[r] < len(self.schedules[r]) or self.sends[r] or any(self.streams[r].values())
        ]
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(self._waiting(r) for r in stuck))
        if self.nccl:  # a rank's step ends when its streams are idle
            for (rank, _), free in self.stream_free.items():
                self.clock[rank] = max(self.clock[rank], free)

    def _advance(self, rank: int) -> bool:
        moved = False
        actions = self.schedules[rank]
        while self.pc[rank] < len(actions):
            moved |= self.nccl is not None and self._advance_streams(rank)
            action = actions[self.pc[rank]]
            if isinstance(action, Compute):
                ran = self._compute(rank, action)
            else:
                ran = self._comm_nccl(rank, action) if self.nccl else self._comm_gloo(rank, action)
            moved |= ran is not False  # None: part of a batch went, the host waits in the rest
            if not ran:
                break
            self.pc[rank] += 1
        moved |= self.nccl is not None and self._advance_streams(rank)
        if self.pc[rank] == len(actions) and self.sends[rank] and self._drain(rank):
            moved = True
        return moved

    def _advance_streams(self, rank: int) -> bool:
        """nccl: start each queue's oldest group call, retire it once all its transfers are
        done, and start the next one then; True if anything moved."""
        moved = False
        for group, batches in self.streams[rank].items():
            while batches:
                head = batches[0]
                if head[0] not in self.started:  # starts when the one before it completed
                    at = max(self.handed_over[head[0]], self.stream_free.get((rank, group), 0.0))
                    self.started.update((side_key, at) for side_key in head)
                    moved = True
                finished = [self.arrival(side_key) for side_key in head]
                if any(t is None for t in finished):
                    break
                self.stream_free[(rank, group)] = max(finished)
                batches.pop(0)
                moved = True
        return moved

    def _compute(self, rank: int, step: Compute) -> bool:
        """Run `step` once its input has arrived; False while it has not."""
        stage = step.chunk * self.p + rank
        unit = (step.phase, step.microbatch, step.chunk)
        if self.forward_only and step.phase != "F":
            raise ScheduleError(f"rank {rank} runs {step} in a forward-only schedule")
        if unit in self.done[rank]:
            raise ScheduleError(f"rank {rank} runs {step} twice")
        needs = None
        if step.phase == "F":
            needs = ("F", step.microbatch, stage - 1, stage) if stage > 0 else None
        elif ("F" if step.phase == "B" else "B", *unit[1:]) not in self.done[rank]:
            before = "forward" if step.phase == "B" else "B"
            raise ScheduleError(f"rank {rank} runs {step} before its {before}")
        elif step.phase == "B" and stage < self.last_stage:
            needs = ("B", step.microbatch, stage + 1, stage)
        start = self.clock[rank]
        if needs is not None:
            if ("recv", needs) not in self.queued:
                raise ScheduleError(f"rank {rank} runs {step} before receiving its input")
            ready = self.arrival(("recv", needs))
            if ready is None:
                return False
            start = max(start, ready)
        end = start + self.compute_cost(rank, step)
        self.sim.intervals.append(Interval(rank, step, start, end))
        self.clock[rank] = end
        self.done[rank].add(unit)
        if step.phase == "F":
            if not (self.forward_only and stage == self.last_stage):  # the last keeps a loss
                self._hold(rank, +1)
        elif step.phase == self.final_phase:
            self._hold(rank, -1)
        return True

    def _hold(self, rank: int, change: int) -> None:
        self.in_flight[rank] += change
        self.sim.peak_in_flight[rank] = max(self.sim.peak_in_flight[rank], self.in_flight[rank])

    def _drain(self, rank: int, keep: int = 0) -> bool:
        """gloo: wait for this rank's sends in flight but the newest `keep` (just posted)."""
        older = self.sends[rank][: len(self.sends[rank]) - keep]
        finished = [self.arrival(("send", key)) for _, key in older]
        if any(t is None for t in finished):
            return False
        self.clock[rank] = max([self.clock[rank], *finished])
        del self.sends[rank][: len(older)]
        return True

    def _queue(self, rank: int, op: P2P, group: Hashable) -> tuple:
        """Hand one transfer to p2p: checked, and recorded in its pair's posting order."""
        side_key = (op.op, transfer_key(op, rank, self.p))
        if side_key in self.queued:
            raise ScheduleError(f"rank {rank} posts {side_key} twice")
        self.queued.add(side_key)
        pair = (rank, op.peer) if op.op == "send" else (op.peer, rank)
        self.order.setdefault((op.op, pair, group), []).append(side_key[1])
        if op.op == "send" and self.forward_only and op.microbatch >= 0:  # let go of when sent
            self.in_flight[rank] -= 1
        return side_key

    def _comm_gloo(self, rank: int, batch: Comm) -> bool:
        """Post the batch (once), then wait for the sends of the rank's earlier batches."""
        if (rank, self.pc[rank]) not in self.posted_batches:
            self.posted_batches.add((rank, self.pc[rank]))
            for op in batch.ops:
                side_key = self._queue(rank, op, None)
                self.started[side_key] = self.clock[rank]
                if op.op == "send":
                    self.sends[rank].append((op, side_key[1]))
        return self._drain(rank, keep=sum(op.op == "send" for op in batch.ops))

    def _comm_nccl(self, rank: int, batch: Comm) -> bool | None:
        """One group call per communicator, in the batch's order, each queued on its queue;
        the host goes on, except in a first contact's handshake (True when the whole batch is
        handed over; None when part of it went, or the host reached a handshake, and waits in
        the handshake; False when nothing changed)."""
        assert self.nccl is not None
        calls = _group_calls(batch, rank, self.nccl.channel)
        went, arrivals = self.calls_done[rank], len(self.arrived)
        while self.calls_done[rank] < len(calls):
            group, ops = calls[self.calls_done[rank]]
            if self.nccl.handshake and not self._connected(rank, group, ops):
                moved = self.calls_done[rank] > went or len(self.arrived) > arrivals
                return None if moved else False
            side_keys = [self._queue(rank, op, group) for op in ops]
            for side_key in side_keys:
                self.handed_over[side_key] = self.clock[rank]
            queue = self.nccl.queue_of(group)
            self.streams[rank].setdefault(queue, []).append(side_keys)
            self.calls_done[rank] += 1
        self.calls_done[rank] = 0
        return True

    def _connected(self, rank: int, group: Hashable, ops: Sequence[P2P]) -> bool:
        """handshake: whether every peer of this group call has reached its first call with
        this rank on `group` (this rank's arrival is recorded at its first try); the host's
        clock moves to the last arrival."""
        peers = {op.peer for op in ops}
        for peer in peers:
            self.arrived.setdefault((group, rank, peer), self.clock[rank])
        if any((group, peer, rank) not in self.arrived for peer in peers):
            return False
        arrivals = [self.arrived[(group, peer, rank)] for peer in peers]
        self.clock[rank] = max([self.clock[rank], *arrivals])
        return True

    def check(self, num_microbatches: int, num_chunks: int) -> None:
        """FIFO matching pairs the right tensors, and every rank ran all its work."""
        for (side, pair, group), order in self.order.items():
            if side == "send" and order != self.order.get(("recv", pair, group)):
                raise ScheduleError(
                    f"ranks {pair[0]} -> {pair[1]} post sends and receives in different orders; "
                    "FIFO matching would swap tensors"
                )
        expected = {
            (ph, i, c)
            for ph in self.phases
            for i in range(num_microbatches)
            for c in range(num_chunks)
        }
        for rank in range(self.p):
            if self.done[rank] != expected:
                missing = sorted(expected - self.done[rank])
                raise ScheduleError(f"rank {rank} never runs {missing[:4]}")

    def _waiting(self, rank: int) -> str:
        """What a stuck rank waits for, for the deadlock message."""
        actions, pc = self.schedules[rank], self.pc[rank]
        action = actions[pc] if pc < len(actions) else None
        where = str(action) if action is not None else "its end"
        blocked = [
            f"{group} stream blocked in " + " ".join(f"{side}-{key}" for side, key in batches[0])
            for group, batches in self.streams[rank].items()
            if batches
        ]
        behind = f"; its {', '.join(blocked)}" if blocked else ""
        if isinstance(action, Compute):
            return f"rank {rank} waits in {where} (for its input{behind})"
        if isinstance(action, Comm) and self.nccl is not None:
            group, ops = _group_calls(action, rank, self.nccl.channel)[self.calls_done[rank]]
            peers = sorted({op.peer for op in ops if (group, op.peer, rank) not in self.arrived})
            if peers:
                return f"rank {rank} waits in {where} (connecting to {peers} on {group}{behind})"
        if not self.sends[rank]:
            return f"rank {rank} waits in {where}{behind}"
        unsent = " ".join(str(op) for op, _ in self.sends[rank])
        return f"rank {rank} waits in {where} (for its {unsent} to be received)"


def _group_calls(
    batch: Comm, rank: int, channel: Callable[[int, P2P], Hashable]
) -> list[tuple[Hashable, list[P2P]]]:
    """A batch as the NCCL group calls it is posted in: one per communicator, in the order of
    each communicator's first operation in the batch."""
    calls: dict[Hashable, list[P2P]] = {}
    for op in batch.ops:
        calls.setdefault(channel(rank, op), []).append(op)
    return list(calls.items())


# every training schedule with pipelining, and evaluation's
PROVEN_KINDS = tuple(k for k in SCHEDULE_KINDS if k != "no-pipelining") + (FORWARD_ONLY,)


def proof_grid() -> list[tuple[str, int, int, int]]:
    """The (kind, p, v, m) cases the schedules are proven on (tests/test_nccl_ordering.py,
    benchmarks/bench_nccl_rules.py): every training schedule and the forward-only one, p = 2,
    3, 4, 8, v = 2..4 interleaved (1 and 2 forward-only, else 1), m = 1..16 (multiples of p
    interleaved): 238 cases."""
    cases = []
    for kind in PROVEN_KINDS:
        vs = [2, 3, 4] if kind in INTERLEAVED_KINDS else [1, 2] if kind == FORWARD_ONLY else [1]
        for p in (2, 3, 4, 8):
            for v in vs:
                for m in (1, 2, 3, 4, 5, 8, 12, 16):
                    if kind not in INTERLEAVED_KINDS or m % p == 0:
                        cases.append((kind, p, v, m))
    return cases


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
