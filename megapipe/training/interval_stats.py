"""What Megatron's training_log accumulates between two log lines, and how it averages.

Losses of iterations that were applied are summed and divided by their number; an iteration
the optimizer skipped (an fp16 overflow) adds no loss, counts as skipped, and as a nan
iteration when its loss was not finite. All counters restart after each log line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class IntervalStats:
    """Running sums for the current log interval."""

    loss_sums: dict[str, float] = field(default_factory=dict)
    advanced_iterations: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0

    def add(self, losses: Mapping[str, float], skipped: bool = False) -> None:
        """Record one iteration's (data-parallel averaged) losses."""
        if skipped:
            self.skipped_iterations += 1
            if any(not math.isfinite(v) for v in losses.values()):
                self.nan_iterations += 1
            return
        self.advanced_iterations += 1
        for name, value in losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value

    @property
    def iterations(self) -> int:
        return self.advanced_iterations + self.skipped_iterations

    def averages(self) -> dict[str, float]:
        """Each loss averaged over the iterations that were applied."""
        count = max(1, self.advanced_iterations)
        return {name: total / count for name, total in self.loss_sums.items()}

    def reset(self) -> None:
        self.loss_sums.clear()
        self.advanced_iterations = self.skipped_iterations = self.nan_iterations = 0
