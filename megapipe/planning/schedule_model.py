"""What the planner needs from a pipeline schedule: its bubble and the micro-batches each rank
keeps in flight.

Known kinds use the closed forms (uniform stages), which the tests check against the
simulator: bubble (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for interleaved 1F1B; in flight on
rank r: m (GPipe), min(p - r, m) (1F1B), min(2(p - r - 1) + (v - 1) p + 1, v m) chunk
forwards (interleaved). Every other kind `schedules.SCHEDULE_KINDS` offers (the zero-bubble
ones) is simulated (`simulator.simulate_kind` at its default costs: F 1, B 2 or B 1 + W 1 per
micro-batch). The simulator is slow for p x m in the thousands, so:

* m > 2p is simulated at m' = 2p: once m >= p the idle time and the peak in flight no longer
  grow with m (the steady state has no idle), so the bubble is idle(m') / (3 m);
* p > 16 is extrapolated from p = 8 and 16: the fill and drain are chains of p - 1 hops, so
  the idle time and the first and last ranks' peaks are affine in p (the tests check both
  rules against the simulator on a grid); ranks between interpolate linearly.
"""

from __future__ import annotations

import functools
import math

from megapipe.pipeline.simulator import simulate_kind

_CLOSED_FORMS = ("no-pipelining", "gpipe", "1f1b", "interleaved-1f1b")
_EXACT_UP_TO = 16  # pipeline sizes simulated as they are; larger ones are extrapolated


@functools.lru_cache(maxsize=4096)
def _simulated(kind: str, p: int, v: int, m: int) -> tuple[float, tuple[int, ...]]:
    """(idle time of the worst rank, peak in flight per rank) at unit costs, m' = min(m, 2p)."""
    sim = simulate_kind(kind, p, v, min(m, 2 * p))
    return max(sim.idle(r) for r in range(p)), tuple(sim.peak_in_flight)


def _extrapolated(kind: str, p: int, v: int, m: int) -> tuple[float, list[int]]:
    if p <= _EXACT_UP_TO:
        idle, flights = _simulated(kind, p, v, m)
        return idle, list(flights)
    lo, hi = _EXACT_UP_TO // 2, _EXACT_UP_TO
    (idle_lo, f_lo), (idle_hi, f_hi) = _simulated(kind, lo, v, m), _simulated(kind, hi, v, m)
    steps = (p - hi) / (hi - lo)
    idle = idle_hi + steps * (idle_hi - idle_lo)
    first = f_hi[0] + steps * (f_hi[0] - f_lo[0])
    last = f_hi[-1] + steps * (f_hi[-1] - f_lo[-1])
    ranks = [first + (last - first) * r / (p - 1) for r in range(p)]
    return idle, [min(math.ceil(f), v * m) for f in ranks]


def bubble_fraction(kind: str, p: int, v: int, m: int) -> float:
    """Idle over ideal compute time of the worst rank, for one step of m micro-batches."""
    if p == 1:
        return 0.0
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / m
    if kind == "interleaved-1f1b":
        return (p - 1) / (v * m)
    return _extrapolated(kind, p, v, m)[0] / (3.0 * m)  # the simulator's work per micro-batch: 3


def in_flight(kind: str, p: int, v: int, m: int) -> list[int]:
    """Peak micro-batches (chunk forwards) each pipeline rank holds for their backward."""
    if p == 1:
        return [1]
    if kind == "gpipe":
        return [m] * p
    if kind == "1f1b":
        return [min(p - r, m) for r in range(p)]
    if kind == "interleaved-1f1b":
        return [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]
    return _extrapolated(kind, p, v, m)[1]


def is_closed_form(kind: str) -> bool:
    return kind in _CLOSED_FORMS
