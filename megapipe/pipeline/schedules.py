"""Pipeline schedules as data: `build_schedule(kind, p, v, m, rank) -> list of actions`.

A schedule is the ordered list of what one pipeline rank does in one training step: forward,
backward or weight-gradient pass of model chunk `c` on micro-batch `i` (`Compute`), and batches
of point-to-point transfers posted together (`Comm`). The same lists drive the executor, the
simulator that proves them deadlock-free, and the timeline plots.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split each backward
into B, the input gradient (what the previous stage waits for), and W, the weight gradient
(what nobody waits for), and run W later, where a rank would otherwise idle. `zero-bubble-h1`
is their ZB-H1: 1F1B's order of forwards and backwards, with rank r running each W r
backwards late (the rest at the end), so every rank holds at most p micro-batches from F to W,
1F1B's peak; `interleaved-zero-bubble` does the same to the interleaved order, each rank's W
2r backwards late, within the interleaved peak of rank 0.

Evaluation runs the `forward-only` schedule: every micro-batch's forward on every chunk, in the
interleaved order when v > 1, with its transfers derived the same way. It is not a training
schedule (not a `--pipeline-schedule` value), so it is listed apart from SCHEDULE_KINDS.

Model chunks and stages: with p ranks and v chunks per rank there are p*v virtual stages; rank
r holds chunks c = 0..v-1, which are virtual stages c*p + r (Megatron's interleaving).

Communication is derived from the compute order, never written by hand. The order is a list of
*units* (one compute, or a steady-state forward+backward pair); between two consecutive units a
rank posts, as one batch, the sends of what the first produced and the receives of everything
the second needs (Megatron's send_forward_recv_backward and, for interleaving,
send_forward_backward_recv_forward_backward). Posting them together is what keeps the
schedules free of deadlock under blocking (rendezvous) send/recv; the simulator checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megapipe.errors import ConfigError

SCHEDULE_KINDS = (
    "no-pipelining",
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zero-bubble-h1",
    "interleaved-zero-bubble",
)
INTERLEAVED_KINDS = ("interleaved-1f1b", "interleaved-zero-bubble")  # need virtual stages
ZERO_BUBBLE_KINDS = ("zero-bubble-h1", "interleaved-zero-bubble")  # backward split into B + W
FORWARD_ONLY = "forward-only"  # evaluation: forwards only, no gradients

Phase = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Compute:
    """Forward ("F"), backward ("B") or deferred weight-gradient pass ("W") of local model chunk
    `chunk` on micro-batch `microbatch`. In schedules without W, B is the whole backward."""

    phase: Phase
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class P2P:
    """One transfer: activations ("F") or their gradients ("B") of (microbatch, local chunk)."""

    op: Literal["send", "recv"]
    phase: Phase
    microbatch: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"{self.op}-{self.phase}{self.microbatch}.{self.chunk}@{self.peer}"


@dataclass(frozen=True)
class Comm:
    """Transfers posted together (one batch_isend_irecv) and completed together."""

    ops: tuple[P2P, ...]

    def __str__(self) -> str:
        return "[" + " ".join(str(op) for op in self.ops) + "]"


Action = Compute | Comm


def _validate_sizes(p: int, v: int, m: int) -> None:
    if p < 1 or v < 1 or m < 1:
        raise ConfigError(
            f"pipeline size ({p}), virtual stages ({v}) and micro-batches ({m}) "
            "must all be positive"
        )


def validate_forward_only(p: int, v: int, m: int) -> None:
    """Raise ConfigError for sizes the forward-only schedule cannot run (any m >= 1 can)."""
    _validate_sizes(p, v, m)
    if v > 1 and p == 1:
        raise ConfigError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1 "
            "(with one stage there is nothing to interleave)"
        )


def validate_schedule(kind: str, p: int, v: int, m: int) -> None:
    """Raise ConfigError, naming the flags, for a combination the schedule cannot run."""
    if kind not in SCHEDULE_KINDS:
        raise ConfigError(f"pipeline schedule {kind!r} is not one of {', '.join(SCHEDULE_KINDS)}")
    _validate_sizes(p, v, m)
    if kind == "no-pipelining" and p != 1:
        raise ConfigError(f"schedule no-pipelining needs --pipeline-model-parallel-size 1, got {p}")
    interleaved = kind in INTERLEAVED_KINDS
    if not interleaved and v != 1:
        raise ConfigError(
            f"schedule {kind} runs one model chunk per rank; virtual stages ({v}) "
            "need the interleaved-1f1b or interleaved-zero-bubble schedule"
        )
    if interleaved and p == 1:
        raise ConfigError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1 "
            "(with one stage there is nothing to interleave)"
        )
    if interleaved and v == 1:
        raise ConfigError(
            f"--pipeline-schedule {kind} needs virtual pipeline stages "
            "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank)"
        )
    if interleaved and m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        allowed = f"{lower} or {upper}" if lower else f"{upper}"
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
            f"of --pipeline-model-parallel-size ({p}): micro-batches pass each model chunk in "
            f"groups of {p}, and a partial group deadlocks the steady state. Use {allowed} "
            f"micro-batches (global batch = micro-batch x data-parallel size x micro-batches)"
        )


Unit = tuple[Compute, ...]


def compute_units(kind: str, p: int, v: int, m: int, rank: int) -> list[Unit]:
    """The order in which `rank` runs its forwards and backwards, grouped into units."""
    if kind == FORWARD_ONLY:
        validate_forward_only(p, v, m)
        return [(f,) for f in _interleaved_forwards(p, v, m)]
    validate_schedule(kind, p, v, m)
    if kind == "gpipe":
        return [(Compute("F", i),) for i in range(m)] + [(Compute("B", i),) for i in range(m)]
    if kind in ("1f1b", "no-pipelining", "zero-bubble-h1"):
        warmup = min(p - rank - 1, m)
        units = [(Compute("F", i),) for i in range(warmup)]
        for j in range(m - warmup):
            units += [(Compute("F", warmup + j),), (Compute("B", j),)]
        units += [(Compute("B", i),) for i in range(m - warmup, m)]
        return _defer_weight_grads(units, lag=rank) if kind == "zero-bubble-h1" else units
    units = _interleaved_units(p, v, m, rank)
    return _defer_weight_grads(units, lag=2 * rank) if kind == "interleaved-zero-bubble" else units


def _defer_weight_grads(units: list[Unit], lag: int) -> list[Unit]:
    """Split every backward into B and a W that runs, as a unit of its own, after the backward
    `lag` backwards later (the last `lag` W's at the end), in backward order.

    While a rank waits on its neighbours (warm-up and cool-down) its W's fill the gap; `lag` W's
    pending on top of the forwards awaiting their B is what bounds the memory: with rank r's
    lag r in 1F1B order (2r interleaved), every rank holds what rank 0 holds (ZB-H1's rule).
    """
    out: list[Unit] = []
    pending: list[Compute] = []
    for unit in units:
        out.append(unit)
        pending += [Compute("W", s.microbatch, s.chunk) for s in unit if s.phase == "B"]
        while len(pending) > lag:
            out.append((pending.pop(0),))
    return out + [(w,) for w in pending]


def compute_order(kind: str, p: int, v: int, m: int, rank: int) -> list[Compute]:
    """The order in which `rank` runs its forwards and backwards."""
    return [step for unit in compute_units(kind, p, v, m, rank) for step in unit]


def _interleaved_forwards(p: int, v: int, m: int) -> list[Compute]:
    """Micro-batches pass chunk 0 in groups of p, then chunk 1, ... (F0..F(m-1) when v = 1)."""
    forwards: list[Compute] = []
    for group_start in range(0, m, p):
        group = range(group_start, min(group_start + p, m))
        forwards += [Compute("F", i, c) for c in range(v) for i in group]
    return forwards


def _interleaved_units(p: int, v: int, m: int, rank: int) -> list[Unit]:
    """Megatron's interleaved 1F1B: forwards in groups of p per chunk, backwards mirrored."""
    forwards = _interleaved_forwards(p, v, m)
    backwards = [Compute("B", f.microbatch, v - 1 - f.chunk) for f in forwards]
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    units = [(f,) for f in forwards[:warmup]]
    units += [(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    return units + [(b,) for b in backwards[total - warmup :]]


def transfer_key(op: P2P, rank: int, p: int) -> tuple[str, int, int, int]:
    """What a send and its matching receive agree on: (phase, microbatch, from, to stage)."""
    stage = op.chunk * p + rank
    if op.phase == "F":
        src, dst = (stage, stage + 1) if op.op == "send" else (stage - 1, stage)
    else:
        src, dst = (stage, stage - 1) if op.op == "send" else (stage + 1, stage)
    return op.phase, op.microbatch, src, dst


Link = tuple[str, int, int]


def p2p_link(rank: int, op: P2P) -> Link:
    """The link `op` of pipeline rank `rank` travels over: (phase, sending rank, receiving rank).

    Each link is a process group of its own (`ParallelState.pp_links`), so on NCCL, which runs
    a group's transfers on one stream in posting order, every stream carries data one way
    between two ranks: a receive posted ahead holds back only later receives from the same
    peer in the same direction, which FIFO matching orders after it anyway, and never a send.
    One group for all transfers (or one per pair of ranks) deadlocks with receives posted
    ahead; the simulator shows it (`simulate(..., ordering="nccl", channel=...)`).
    """
    return (op.phase, rank, op.peer) if op.op == "send" else (op.phase, op.peer, rank)


def _neighbours(step: Compute, rank: int, p: int, v: int) -> tuple[P2P | None, P2P | None]:
    """(what `step` must receive first, what it must send afterwards), or None at the ends
    (and for W, which only needs what its own B left behind)."""
    if step.phase == "W":
        return None, None
    stage = step.chunk * p + rank
    last = p * v - 1
    prev_stage, next_stage = stage - 1, stage + 1
    if step.phase == "F":
        recv = P2P("recv", "F", step.microbatch, step.chunk, prev_stage % p) if stage else None
        send = (
            P2P("send", "F", step.microbatch, step.chunk, next_stage % p) if stage < last else None
        )
    else:
        recv = (
            P2P("recv", "B", step.microbatch, step.chunk, next_stage % p) if stage < last else None
        )
        send = P2P("send", "B", step.microbatch, step.chunk, prev_stage % p) if stage else None
    return recv, send


def build_schedule(
    kind: str, p: int, v: int, m: int, rank: int, *, post_ahead: bool = False
) -> list[Action]:
    """Every action `rank` performs in one step, communication included.

    kind: one of SCHEDULE_KINDS (training), or FORWARD_ONLY (evaluation).
    post_ahead: post each unit's receives one unit early, in the batch before the previous
    unit (the first batch holds the first two units' receives), so that data can arrive while
    the previous unit computes instead of after it; the executor still waits for a receive only
    just before the compute that needs it. Per peer, receives keep their order, so FIFO
    matching is unchanged.
    """
    if not 0 <= rank < p:
        raise ConfigError(f"rank {rank} is outside a pipeline of {p} ranks")
    units = compute_units(kind, p, v, m, rank)
    ends = [[_neighbours(step, rank, p, v) for step in unit] for unit in units]
    receives = [[recv for recv, _ in unit_ends if recv is not None] for unit_ends in ends]
    lead = 1 if post_ahead else 0

    def ordered(ops: list[P2P]) -> list[P2P]:
        # Sorted by transfer key on both sides, so that several transfers between the same two
        # ranks are posted in the same order there and here (p2p matches in FIFO order).
        return sorted(ops, key=lambda op: transfer_key(op, rank, p))

    actions: list[Action] = []
    pending_sends: list[P2P] = []
    for k, unit in enumerate(units):
        batch = [op for j in range(lead) if k == 0 for op in ordered(receives[j])]
        batch += ordered(pending_sends + (receives[k + lead] if k + lead < len(units) else []))
        if batch:
            actions.append(Comm(tuple(batch)))
        actions.extend(unit)
        pending_sends = [send for _, send in ends[k] if send is not None]
    if pending_sends:
        actions.append(Comm(tuple(pending_sends)))
    return actions


def format_schedule(actions: list[Action]) -> str:
    """One line, for logs and error messages: `F0 [send-F0.0@1 recv-B0.0@1] B0 ...`."""
    return " ".join(str(a) for a in actions)
