"""Pipeline timelines as boxes: one per forward, backward, weight-gradient pass (zero-bubble
schedules' W) or transfer batch, per rank.

Two sources give the same shape of data, so one drawing function serves both: the simulator
(a schedule under the cost model forward 1/v, backward 2/v per chunk; split: B and W 1/v each)
and a measured Chrome trace written by `--pipeline-trace` (one iteration of it). Everything
here is pure; drawing lives in `timeline_plot.py`, the only place that needs matplotlib.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Literal

from megapipe.errors import MegapipeError
from megapipe.pipeline.schedules import SCHEDULE_KINDS, ZERO_BUBBLE_KINDS, Compute
from megapipe.pipeline.simulator import Simulation, replay, simulate_kind
from megapipe.pipeline.trace import TRACE_CATEGORIES

BoxKind = Literal["F", "B", "W", "comm"]


class TraceFormatError(MegapipeError, ValueError):
    """A trace file that is not a pipeline Chrome trace, or lacks the requested step."""


@dataclass(frozen=True)
class Box:
    """One action on one rank's row, from `start` to `end` (simulated units or ms)."""

    rank: int
    kind: BoxKind
    start: float
    end: float
    microbatch: int = -1  # -1 for transfers
    chunk: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    def label(self, num_chunks: int) -> str:
        """`3` for micro-batch 3, or `3.1` (micro-batch.chunk) when ranks hold several chunks."""
        if self.kind == "comm":
            return ""
        return f"{self.microbatch}.{self.chunk}" if num_chunks > 1 else f"{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """What a picture shows: boxes, the pipeline's shape, and a title."""

    boxes: tuple[Box, ...]
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    title: str
    time_unit: str  # "ms" for measured traces, "" for simulated time

    @property
    def makespan(self) -> float:
        return max(b.end for b in self.boxes) - min(b.start for b in self.boxes)

    def compute_efficiency(self) -> float:
        """Compute time over p x makespan: the fraction of the ranks' time spent computing."""
        busy = sum(b.duration for b in self.boxes if b.kind != "comm")
        return busy / (self.num_ranks * self.makespan)


def theoretical_efficiency(p: int, v: int, m: int, kind: str | None = None) -> float:
    """The bubble bound: m / (m + p - 1) for 1F1B and GPipe, v*m / (v*m + p - 1) interleaved;
    for a schedule `kind`, 1 / (1 + its simulated bubble) under the cost model F = B = W (for
    zero-bubble-h1 3m / (3m + p - 1), the paper's bubble)."""
    if kind in SCHEDULE_KINDS:
        return 1.0 / (1.0 + simulate_kind(kind, p, v, m).bubble_fraction())
    return v * m / (v * m + p - 1)


def boxes_from_simulation(sim: Simulation) -> list[Box]:
    """One box per simulated forward and backward, in simulated time."""
    return [
        Box(i.rank, i.action.phase, i.start, i.end, i.action.microbatch, i.action.chunk)
        for i in sim.intervals
    ]


def simulated_timeline(kind: str, p: int, v: int, m: int) -> Timeline:
    """Simulate `kind` (raises ConfigError for combinations it cannot run) as a Timeline."""
    sim = simulate_kind(kind, p, v, m)
    bubble = sim.bubble_fraction()
    costs = "forward, B and W" if kind in ZERO_BUBBLE_KINDS else "forward 1/v, backward 2/v"
    costs += " 1/v each" if kind in ZERO_BUBBLE_KINDS else ""
    title = (
        f"{kind}, p={p}, v={v}, m={m} (simulated; {costs} per chunk)\n"
        f"bubble {bubble:.1%} of compute time; compute fills {1 / (1 + bubble):.1%} of p x "
        "step time"
    )
    return Timeline(tuple(boxes_from_simulation(sim)), p, m, v, title, "")


def load_trace(path: str) -> dict:
    """Read a Chrome-trace JSON document; TraceFormatError (one line) if it is not one."""
    try:
        with open(path) as f:
            document = json.load(f)
    except OSError as error:
        raise TraceFormatError(f"cannot read trace {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"trace {path} is not JSON: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise TraceFormatError(f"trace {path} has no traceEvents list (not a Chrome trace)")
    return document


def _action_events(document: dict) -> list[dict]:
    return [
        e
        for e in document["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in (*TRACE_CATEGORIES.values(), "comm")
    ]


def trace_steps(document: dict) -> list[int]:
    """The iterations a trace recorded, in order."""
    return sorted({int(e.get("args", {}).get("step", 0)) for e in _action_events(document)})


def boxes_from_trace(document: dict, step: int | None = None) -> list[Box]:
    """The boxes of iteration `step` (default: the last recorded), in ms from its first event."""
    steps = trace_steps(document)
    if not steps:
        raise TraceFormatError("the trace holds no pipeline actions")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise TraceFormatError(f"the trace has no step {step}; it recorded steps {steps}")
    events = [e for e in _action_events(document) if e.get("args", {}).get("step", 0) == step]
    origin = min(e["ts"] for e in events)
    kinds: dict[str, BoxKind] = {cat: phase for phase, cat in TRACE_CATEGORIES.items()}
    kinds["comm"] = "comm"
    boxes = []
    for e in events:
        args = e.get("args", {})
        start = (e["ts"] - origin) / 1000.0
        boxes.append(
            Box(
                int(e["tid"]),
                kinds[e["cat"]],
                start,
                start + e["dur"] / 1000.0,
                int(args.get("microbatch", -1)),
                int(args.get("chunk", 0)),
            )
        )
    return sorted(boxes, key=lambda b: (b.rank, b.start))


def measured_timeline(document: dict, step: int | None = None) -> Timeline:
    """One iteration of a measured trace as a Timeline, titled with its efficiency."""
    boxes = boxes_from_trace(document, step)
    step = trace_steps(document)[-1] if step is None else step
    meta = document.get("otherData", {})
    p = int(meta.get("pipeline_size", max(b.rank for b in boxes) + 1))
    compute = [b for b in boxes if b.kind != "comm"]
    v = int(meta.get("virtual_stages", max(b.chunk for b in compute) + 1))
    m = int(meta.get("num_microbatches", max(b.microbatch for b in compute) + 1))
    kind = meta.get("schedule", "pipeline")
    timeline = Timeline(tuple(boxes), p, m, v, "", "ms")
    efficiency = timeline.compute_efficiency()
    if kind in ZERO_BUBBLE_KINDS:
        bound, formula = theoretical_efficiency(p, v, m, kind), "simulated, F=B=W"
    else:
        bound = theoretical_efficiency(p, v, m)
        formula = "v*m/(v*m+p-1)" if v > 1 else "m/(m+p-1)"
    title = (
        f"{kind}, p={p}, v={v}, m={m} (measured, iteration {step}: "
        f"{timeline.makespan:.0f} ms)\ncompute fills {efficiency:.1%} of p x step time "
        f"(bubble bound {formula} = {bound:.1%})"
    )
    replayed = replayed_makespan(timeline, kind, bool(meta.get("receives_ahead", False)))
    if replayed is not None:
        lost = 1.0 - replayed / timeline.makespan
        title += (
            f"\nthese computes with free transfers: {replayed:.0f} ms; communication and the "
            f"executor took {lost:.1%} of the step"
        )
    return replace(timeline, title=title)


def replayed_makespan(timeline: Timeline, kind: str, post_ahead: bool) -> float | None:
    """The measured computes replayed through schedule `kind` with free transfers
    (`simulator.replay`), in the timeline's unit; None when `kind` is not a training schedule
    or the boxes are not exactly its computes (a partial trace)."""
    if kind not in SCHEDULE_KINDS:
        return None
    durations = {
        (b.rank, Compute(b.kind, b.microbatch, b.chunk)): b.duration
        for b in timeline.boxes
        if b.kind != "comm"
    }
    try:
        sim = replay(kind, timeline.num_ranks, timeline.num_chunks, timeline.num_microbatches,
                     durations, post_ahead=post_ahead)  # fmt: skip
    except (KeyError, RuntimeError, ValueError):
        return None
    if len(sim.intervals) != len(durations):
        return None
    return sim.makespan
