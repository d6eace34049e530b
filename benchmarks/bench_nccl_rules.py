"""What NCCL's rules do to the pipeline schedules, in the simulator: the grid of hangs before and
now, and what posting receives ahead buys under the rules (no processes, a few seconds).

Grid: every training schedule and the forward-only one over p = 2, 3, 4, 8, v = 1..4 and
m = 1..16 (tests/test_nccl_ordering.py's 238 cases), each posted late and ahead, under four
models of NCCL: a stream per communicator (what megapipe assumed before), the lazy connection
handshake alone, one queue per rank alone, and both. "before": a communicator per direction
between two stages with every receive one unit early (`megapipe.testing.posting_before`);
"one group before": the design before that (one communicator, every receive one unit early);
"now": the pipeline's communicator with receives early only over units that send nothing and
the start-up connections first (`schedules.build_schedule`, `schedules.connect_schedule`).
A cell is hangs / cases.

Overlap: p = 4, m = 8 (v = 2 interleaved), transfers costing 0.05 and 0.2 of a forward, the
simulated step under both rules, posted late and ahead, and the step of the posting before
under gloo's rule (which it relied on), its makespan being what the old design would take if
NCCL progressed every stream on its own.

    python benchmarks/bench_nccl_rules.py [--json PATH]
"""

from __future__ import annotations

import argparse
import os

from megapipe.atomic_files import write_json
from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    ZERO_BUBBLE_KINDS,
    build_schedule,
    connect_schedule,
)
from megapipe.pipeline.simulator import PROVEN_KINDS, ScheduleError, proof_grid, simulate
from megapipe.testing.posting_before import (
    link_channel,
    receives_just_before,
    receives_one_unit_early,
)

KINDS = PROVEN_KINDS
RULES = {
    "streams": {},
    "handshake": {"handshake": True},
    "one-queue": {"queue": "rank"},
    "both": {"handshake": True, "queue": "rank"},
}
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "nccl_rules.json")


def _lists(design: str, kind: str, p: int, v: int, m: int, ahead: bool):
    """(every rank's list, the communicator of each transfer) of a design."""
    if design == "now":
        return [
            connect_schedule(p, v, r) + build_schedule(kind, p, v, m, r, post_ahead=ahead)
            for r in range(p)
        ], None
    if ahead:
        lists = [receives_one_unit_early(kind, p, v, m, r) for r in range(p)]
    else:  # late then: every receive just before its unit; no W moves (as it was)
        lists = [receives_just_before(kind, p, v, m, r) for r in range(p)]
    return lists, (link_channel if design == "before" else None)


def _costs(kind: str, v: int) -> dict[str, float]:
    split = kind in ZERO_BUBBLE_KINDS
    return {"forward_cost": 1 / v, "backward_cost": (1 if split else 2) / v, "weight_cost": 1 / v}


def simulated(design, kind, p, v, m, ahead, ordering="nccl", comm_cost=0.0, **rules):
    """The simulation of one case, or None when it hangs."""
    lists, channel = _lists(design, kind, p, v, m, ahead)
    extra = {"channel": channel} if channel is not None else {}
    try:
        return simulate(lists, m, v, forward_only=kind == FORWARD_ONLY, ordering=ordering,
                        comm_cost=comm_cost, **_costs(kind, v), **extra, **rules)  # fmt: skip
    except ScheduleError:
        return None


def hang_grid() -> dict:
    cases = proof_grid()
    table: dict = {}
    for design in ("one group before", "before", "now"):
        for ahead in (True, False):
            row = {}
            for rule, options in RULES.items():
                for kind in KINDS:
                    mine = [c for c in cases if c[0] == kind]
                    hangs = sum(
                        simulated(design, k, p, v, m, ahead, **options) is None
                        for k, p, v, m in mine
                    )
                    row[f"{rule}:{kind}"] = [hangs, len(mine)]
            table[f"{design}, {'ahead' if ahead else 'late'}"] = row
    return table


def overlap() -> dict:
    rows = {}
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("zero-bubble-h1", 1), ("interleaved-1f1b", 2),
                    ("interleaved-zero-bubble", 2)]:  # fmt: skip
        for cost in (0.05, 0.2):
            both = RULES["both"]
            late = simulated("now", kind, 4, v, 8, False, comm_cost=cost, **both)
            ahead = simulated("now", kind, 4, v, 8, True, comm_cost=cost, **both)
            before = simulated("before", kind, 4, v, 8, True, ordering="gloo", comm_cost=cost)
            rows[f"{kind} @ {cost}"] = {
                "late": late.makespan,
                "ahead": ahead.makespan,
                "before_if_streams_were_free": before.makespan,
            }
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    table, rows = hang_grid(), overlap()
    rules = list(RULES)
    print("hangs / cases under each model of NCCL (columns: rule, then schedule)")
    header = " | ".join(f"{r}" for r in rules)
    print(f"{'design, posting':<28} {header}")
    for name, row in table.items():
        cells = []
        for rule in rules:
            total = [sum(row[f"{rule}:{k}"][i] for k in KINDS) for i in (0, 1)]
            cells.append(f"{total[0]}/{total[1]}")
        print(f"{name:<28} " + " | ".join(cells))
    print("\nper schedule, both rules:")
    for name, row in table.items():
        print(f"  {name:<26} " + ", ".join(f"{k} {row['both:' + k][0]}/{row['both:' + k][1]}"
                                          for k in KINDS))  # fmt: skip
    print("\nsimulated step, p=4 m=8, both rules (before: under gloo's rule, streams free)")
    print(f"{'schedule @ transfer cost':<34}{'late':>8}{'ahead':>8}{'before':>8}{'ahead/late':>12}")
    for name, row in rows.items():
        before, ratio = row["before_if_streams_were_free"], row["ahead"] / row["late"]
        print(f"{name:<34}{row['late']:>8.2f}{row['ahead']:>8.2f}{before:>8.2f}{ratio:>12.3f}")
    write_json(args.json, {"hangs": table, "overlap": rows})
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
