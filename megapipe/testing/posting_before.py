"""How megapipe posted pipeline transfers before it relied only on what NCCL promises, kept as
the hazard the model and the emulation must catch (tests/test_nccl_ordering.py,
tests/test_pipeline_failures.py) and the baseline the overlap is measured against
(benchmarks/bench_p2p_posting.py).

Then every unit's receives went in the batch before the unit ahead of it, whatever that unit
sent (the first batch held the first two units' receives; `receives_one_unit_early`, the
default) or in the batch just before it (`receives_just_before`), and each direction between
two stages had a communicator of its own (`link_channel`).
"""

from __future__ import annotations

from megapipe.pipeline.schedules import (
    P2P,
    Action,
    Comm,
    compute_units,
    neighbour_transfers,
    transfer_key,
)


def link_channel(rank: int, op: P2P) -> tuple[str, int, int]:
    """The communicator of `op` then: one per direction between two stages."""
    return (op.phase, rank, op.peer) if op.op == "send" else (op.phase, op.peer, rank)


def receives_one_unit_early(kind: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """`rank`'s actions with every receive posted one unit early (the default then)."""
    units = compute_units(kind, p, v, m, rank)
    ends = [[neighbour_transfers(step, rank, p, v) for step in unit] for unit in units]
    receives = [[recv for recv, _ in unit_ends if recv is not None] for unit_ends in ends]

    def ordered(ops: list[P2P]) -> list[P2P]:
        return sorted(ops, key=lambda op: transfer_key(op, rank, p))

    actions: list[Action] = []
    sends: list[P2P] = []
    for k, unit in enumerate(units):
        batch = ordered(receives[0]) if k == 0 else []
        batch += ordered(sends + (receives[k + 1] if k + 1 < len(units) else []))
        if batch:
            actions.append(Comm(tuple(batch)))
        actions.extend(unit)
        sends = [send for _, send in ends[k] if send is not None]
    return actions + ([Comm(tuple(sends))] if sends else [])


def receives_just_before(kind: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """`rank`'s actions with every receive in the batch just before its unit
    (--no-overlap-p2p-communication then; a W unit splitting batches like any other)."""
    units = compute_units(kind, p, v, m, rank)
    ends = [[neighbour_transfers(step, rank, p, v) for step in unit] for unit in units]
    actions: list[Action] = []
    sends: list[P2P] = []
    for k, unit in enumerate(units):
        ops = sends + [recv for recv, _ in ends[k] if recv is not None]
        if ops:
            actions.append(Comm(tuple(sorted(ops, key=lambda op: transfer_key(op, rank, p)))))
        actions.extend(unit)
        sends = [send for _, send in ends[k] if send is not None]
    return actions + ([Comm(tuple(sends))] if sends else [])
