"""Measured pipeline timelines as Chrome-trace JSON (open in Perfetto or chrome://tracing).

Each rank records the wall-clock start and end of every action it runs; at the end of training
the records are gathered to global rank 0, which writes one file: one row per pipeline rank,
forward, backward and (zero-bubble schedules) weight-gradient passes as separate categories,
communication batches in another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from megapipe.atomic_files import write_json
from megapipe.pipeline.schedules import Action, Compute

TRACE_CATEGORIES = {"F": "forward", "B": "backward", "W": "weight-grad"}


@dataclass
class TraceRecorder:
    """The actions of one rank, with start/end in seconds (time.perf_counter), per step.
    `peers`: who else takes part in this rank's computes (its global rank, and the tensor- and
    context-parallel groups' global ranks where they have more than one), put in each compute
    event's args, so a slow forward can be traced to the group it waited on."""

    rank: int
    step: int = 0
    events: list[dict] = field(default_factory=list)
    peers: dict = field(default_factory=dict)

    def record(self, action: Action, start: float, end: float) -> None:
        if isinstance(action, Compute):
            category = TRACE_CATEGORIES[action.phase]
            args = {"microbatch": action.microbatch, "chunk": action.chunk, **self.peers}
        else:
            category, args = "comm", {"ops": [str(op) for op in action.ops]}
        self.events.append(
            {
                "name": str(action),
                "cat": category,
                "ph": "X",
                "pid": 0,
                "tid": self.rank,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {**args, "step": self.step},
            }
        )


def chrome_trace(events_per_rank: list[list[dict]], metadata: dict | None = None) -> dict:
    """One Chrome-trace document; timestamps shifted so the earliest event starts at 0.

    metadata (the schedule and its sizes) goes to `otherData`, which trace viewers show and
    tools/plot_schedule.py reads for its title.
    """
    events = [e for rank_events in events_per_rank for e in rank_events]
    origin = min((e["ts"] for e in events), default=0.0)
    shifted = [{**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)} for e in events]
    names = [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": r,
            "args": {"name": f"pipeline rank {r}"},
        }
        for r in range(len(events_per_rank))
    ]
    document = {"traceEvents": names + shifted, "displayTimeUnit": "ms"}
    if metadata:
        document["otherData"] = metadata
    return document


def gather_and_write(
    recorder: TraceRecorder,
    path: str,
    pp_group_ranks: tuple[int, ...],
    metadata: dict | None = None,
) -> None:
    """Collective over the world: rank 0 writes the trace of the pipeline `pp_group_ranks`."""
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(recorder.events, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0:
        write_json(path, chrome_trace([gathered[r] for r in pp_group_ranks], metadata))
