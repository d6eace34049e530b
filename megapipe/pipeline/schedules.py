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
send_forward_backward_recv_forward_backward), all on the pipeline's one communicator
(`p2p_channel`). Posting them together is what keeps the schedules free of deadlock under
blocking (rendezvous) send/recv, one queue per rank and lazy connections; the simulator checks
it (`build_schedule` says where receives may go early).
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


PIPELINE_COMMUNICATOR = "pp"


def p2p_channel(rank: int, op: P2P) -> str:
    """The communicator `op` of pipeline rank `rank` travels over: the pipeline's one process
    group, as in Megatron-LM, so that each `Comm` is one NCCL group call whatever its peers.

    A group (and so a stream) per direction between two stages, which megapipe had before,
    relies on streams progressing independently and on connections made in an order the
    schedule does not fix; NCCL and CUDA promise neither (`simulator.py`'s two rules), and the
    simulator shows that design hanging under each rule (tests/test_nccl_ordering.py).
    """
    return PIPELINE_COMMUNICATOR


def neighbour_transfers(step: Compute, rank: int, p: int, v: int) -> tuple[P2P | None, P2P | None]:
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

    Between two consecutive units a rank posts one batch (one NCCL group call on the
    pipeline's communicator): the sends of what the first unit produced and the receives of
    what the second needs, Megatron's send_forward_recv_backward and its kin. A unit's
    receives move one batch earlier, into the batch before the unit ahead of it, when that
    unit sends nothing: no send of this rank then stands between the receive's old and new
    place in its queue, so the move cannot make a peer wait for this rank where it did not
    before, under any of NCCL's rules (the simulator checks it). A W unit (zero-bubble weight
    gradients) never splits a batch in two, so that a send before it and a receive after it
    go in one group call, whose operations progress together (two calls, each rank sending
    first, hang NCCL in the zero-bubble cool-down).

    post_ahead (--overlap-p2p-communication, the default): receives move over every unit that
    sends nothing, so that data can arrive while it computes (the executor still waits for a
    receive only just before the compute that needs it); otherwise only over W units. Per
    peer, receives keep their order, so FIFO matching is unchanged.
    """
    if not 0 <= rank < p:
        raise ConfigError(f"rank {rank} is outside a pipeline of {p} ranks")
    units = compute_units(kind, p, v, m, rank)
    ends = [[neighbour_transfers(step, rank, p, v) for step in unit] for unit in units]
    receives = [[recv for recv, _ in unit_ends if recv is not None] for unit_ends in ends]
    sends = [[send for _, send in unit_ends if send is not None] for unit_ends in ends]

    def moves_over(unit: Unit, unit_sends: list[P2P]) -> bool:
        return not unit_sends if post_ahead else all(step.phase == "W" for step in unit)

    early = [k > 0 and moves_over(units[k - 1], sends[k - 1]) for k in range(len(units))]

    def ordered(ops: list[P2P]) -> list[P2P]:
        # Sorted by transfer key on both sides, so that several transfers between the same two
        # ranks are posted in the same order there and here (p2p matches in FIFO order).
        return sorted(ops, key=lambda op: transfer_key(op, rank, p))

    actions: list[Action] = []
    for k in range(len(units) + 1):
        batch = list(sends[k - 1]) if k else []
        if k < len(units) and not early[k]:
            batch += receives[k]
        if k + 1 < len(units) and early[k + 1]:
            batch += receives[k + 1]
        if batch:
            actions.append(Comm(tuple(ordered(batch))))
        if k < len(units):
            actions.extend(units[k])
    return actions


def connect_schedule(p: int, v: int, rank: int) -> list[Comm]:
    """The start-up warm-up that makes every connection a schedule over `v` chunks per rank
    uses, as batches `rank` posts: for each pair of neighbouring ranks, in one global order
    ((0, 1), (1, 2), ..., then the wrap-around (p-1, 0) that interleaving adds), both post one
    batch exchanging a token ("F" one way, "B" the other, micro-batch -1). Every rank meets
    its pairs in that order, so no two ranks wait for each other in opposite orders, and the
    first contact of each pair is matched: NCCL's lazy connection handshake completes
    whatever the posting of the steps after it (the simulator proves both)."""
    if not 0 <= rank < p:
        raise ConfigError(f"rank {rank} is outside a pipeline of {p} ranks")
    pairs = [(i, i + 1) for i in range(p - 1)]
    if v > 1 and p > 2:
        pairs.append((p - 1, 0))
    batches: list[Comm] = []
    for low, high in pairs:
        wrap = high < low  # the last rank's chunk c feeds the first rank's chunk c + 1
        if rank == low:
            send = P2P("send", "F", -1, 0, high)
            recv = P2P("recv", "B", -1, 0, high)
        elif rank == high:
            send = P2P("send", "B", -1, 1 if wrap else 0, low)
            recv = P2P("recv", "F", -1, 1 if wrap else 0, low)
        else:
            continue
        batches.append(Comm(tuple(sorted((send, recv), key=lambda op: transfer_key(op, rank, p)))))
    return batches


def format_schedule(actions: list[Action]) -> str:
    """One line, for logs and error messages: `F0 [send-F0.0@1 recv-B0.0@1] B0 ...`."""
    return " ".join(str(a) for a in actions)
