"""Run every rank's action list together, without processes, to prove a schedule sound.

Semantics are the strict ones: a `Comm` batch completes only when every transfer in it has
been posted by its peer too (rendezvous send/recv, no buffering), a compute may only start
once its input has been received, and between two ranks sends and receives must be posted in
the same order (NCCL and gloo match point-to-point messages first-in first-out). A schedule
that passes here cannot deadlock on real p2p, and its timeline under a cost model (forward 1,
backward 2, transfers free) gives the bubble.

A forward-only (evaluation) schedule is checked the same way, expecting every forward and no
backward; its in-flight count is then the outputs computed but not yet sent downstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    Action,
    Comm,
    Compute,
    build_schedule,
    transfer_key,
)


class ScheduleError(RuntimeError):
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
) -> Simulation:
    """Execute all ranks' lists; raise ScheduleError on deadlock or incomplete work.

    forward_only: the lists must run every forward and no backward; `peak_in_flight` then
    counts outputs not yet sent (what an evaluation step holds), not micro-batches awaiting
    their backward.
    """
    p = len(schedules)
    pc = [0] * p
    clock = [0.0] * p
    posted: dict[tuple, float] = {}  # (side, key) -> post time
    posted_batches: set[tuple[int, int]] = set()
    channel_order: dict[tuple, list] = {}  # (side, (src, dst)) -> transfer keys in post order
    received: list[set] = [set() for _ in range(p)]
    forwarded: list[set] = [set() for _ in range(p)]
    done: list[set] = [set() for _ in range(p)]
    in_flight = [0] * p
    sim = Simulation(p, peak_in_flight=[0] * p)
    last_stage = p * num_chunks - 1

    def run_compute(rank: int, step: Compute) -> None:
        stage = step.chunk * p + rank
        unit = (step.phase, step.microbatch, step.chunk)
        if forward_only and step.phase == "B":
            raise ScheduleError(f"rank {rank} runs {step} in a forward-only schedule")
        if unit in done[rank]:
            raise ScheduleError(f"rank {rank} runs {step} twice")
        if step.phase == "F":
            needs = ("F", step.microbatch, stage - 1, stage) if stage > 0 else None
        else:
            if (step.microbatch, step.chunk) not in forwarded[rank]:
                raise ScheduleError(f"rank {rank} runs {step} before its forward")
            needs = ("B", step.microbatch, stage + 1, stage) if stage < last_stage else None
        if needs is not None and needs not in received[rank]:
            raise ScheduleError(f"rank {rank} runs {step} before receiving its input")
        cost = forward_cost if step.phase == "F" else backward_cost
        sim.intervals.append(Interval(rank, step, clock[rank], clock[rank] + cost))
        clock[rank] += cost
        done[rank].add(unit)
        if step.phase == "F":
            forwarded[rank].add((step.microbatch, step.chunk))
            if not (forward_only and stage == last_stage):  # the last stage keeps only a loss
                in_flight[rank] += 1
                sim.peak_in_flight[rank] = max(sim.peak_in_flight[rank], in_flight[rank])
        else:
            in_flight[rank] -= 1

    def try_comm(rank: int, batch: Comm) -> bool:
        keys = [(op.op, transfer_key(op, rank, p)) for op in batch.ops]
        if (rank, pc[rank]) not in posted_batches:
            posted_batches.add((rank, pc[rank]))
            for op, side_key in zip(batch.ops, keys):
                if side_key in posted:
                    raise ScheduleError(f"rank {rank} posts {side_key} twice")
                posted[side_key] = clock[rank]
                pair = (rank, op.peer) if op.op == "send" else (op.peer, rank)
                channel_order.setdefault((op.op, pair), []).append(side_key[1])
        partners = [("recv" if side == "send" else "send", key) for side, key in keys]
        if not all(partner in posted for partner in partners):
            return False
        finish = max(max(posted[k], posted[q]) for k, q in zip(keys, partners)) + comm_cost
        clock[rank] = max(clock[rank], finish)
        for side, key in keys:
            if side == "recv":
                received[rank].add(key)
            elif forward_only:  # the output is released once it is sent
                in_flight[rank] -= 1
        return True

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pc[rank] < len(schedules[rank]):
                action = schedules[rank][pc[rank]]
                if isinstance(action, Compute):
                    run_compute(rank, action)
                elif not try_comm(rank, action):
                    break
                pc[rank] += 1
                progress = True

    stuck = [r for r in range(p) if pc[r] < len(schedules[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits in {schedules[r][pc[r]]}" for r in stuck)
        raise ScheduleError(f"deadlock: {waits}")
    for (side, pair), order in channel_order.items():
        if side == "send" and order != channel_order.get(("recv", pair)):
            raise ScheduleError(
                f"ranks {pair[0]} -> {pair[1]} post sends and receives in different orders; "
                "FIFO matching would swap tensors"
            )
    phases = "F" if forward_only else "FB"
    expected = {
        (ph, i, c) for ph in phases for i in range(num_microbatches) for c in range(num_chunks)
    }
    for rank in range(p):
        if done[rank] != expected:
            missing = sorted(expected - done[rank])
            raise ScheduleError(f"rank {rank} never runs {missing[:4]}")
    return sim


def simulate_kind(kind: str, p: int, v: int, m: int, **costs: float) -> Simulation:
    """Build every rank's schedule of `kind` and simulate them together.

    Per-chunk costs default to 1/v forward and 2/v backward, so a rank's work per micro-batch
    is 1 + 2 whatever v, and bubble fractions compare across schedules.
    """
    costs.setdefault("forward_cost", 1.0 / v)
    costs.setdefault("backward_cost", 2.0 / v)
    schedules = [build_schedule(kind, p, v, m, r) for r in range(p)]
    return simulate(schedules, m, v, forward_only=kind == FORWARD_ONLY, **costs)
