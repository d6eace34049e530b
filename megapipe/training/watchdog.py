"""A watchdog thread that ends a rank whose step takes far longer than its steps usually do.

Process-group timeouts bound each collective, but a rank can also wait in something no
timeout covers (an NCCL kernel that never completes, a peer that stalls between collectives),
and a timeout's own error rarely says which of the step's many operations was stuck. The
watchdog reads the rank's `Activity` once every poll: when the current step has run longer
than `factor` x the median of the recent steps (and at least `min_seconds`), or any other
phase (the first step, an evaluation, a save) has made no progress (entered no new
operation) for `max_seconds`, it prints one line
naming the phase and the operation this rank is waiting in, then ends the process with
`os._exit` (a thread cannot interrupt a collective that is stuck in C++, and no cleanup that
might wait on a dead peer runs). The launcher then sees a failed rank: torchrun tears the
other ranks down and, with --max-restarts, restarts the job from its last checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from megapipe.activity import Activity

EXIT_STATUS = 3  # what a rank the watchdog ended exits with
IDLE_PHASES = ("done",)


@dataclass(frozen=True)
class WatchdogSettings:
    """--watchdog-timeout-factor (0: off), --watchdog-min-seconds, --watchdog-max-seconds."""

    factor: float
    min_seconds: float
    max_seconds: float

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class Watchdog:
    """Polls `activity` on a daemon thread; `overdue()` is the decision, `start()` the thread."""

    def __init__(
        self,
        activity: Activity,
        settings: WatchdogSettings,
        *,
        out: TextIO | None = None,
        exit_status: int = EXIT_STATUS,
    ) -> None:
        self.activity = activity
        self.settings = settings
        self.out = out
        self.exit_status = exit_status
        self.poll_seconds = min(1.0, max(0.05, settings.min_seconds / 20))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bound(self) -> tuple[float, str]:
        """How long the current phase may run, and why that long."""
        s = self.settings
        phase = self.activity.phase[0]
        median = self.activity.median_step_seconds()
        if phase == "step" and median is not None:
            bound = max(s.min_seconds, s.factor * median)
            why = (
                f"{s.factor:g} x the median step time {median:.2f} s, at least "
                f"--watchdog-min-seconds {s.min_seconds:g}"
            )
            return bound, why
        what = "no step time measured yet" if phase == "step" else f"for a {phase}"
        return s.max_seconds, f"--watchdog-max-seconds {s.max_seconds:g}, {what}"

    def overdue(self, now: float | None = None) -> str | None:
        """The message to exit with when the current phase has run past its bound, else None.

        A step is timed as a whole once there is a median to compare with; anything else (an
        evaluation of many batches, a save, the first step) by the time since its last
        operation began, so a long evaluation that keeps making progress is never cut short."""
        phase, _, since = self.activity.phase
        if phase in IDLE_PHASES:
            return None
        bound, why = self.bound()
        timed_whole = phase == "step" and self.activity.median_step_seconds() is not None
        if not timed_whole:
            since = max(since, self.activity.current[3])
        elapsed = (time.monotonic() if now is None else now) - since
        if elapsed <= bound:
            return None
        ran = "has run" if timed_whole else "has made no progress for"
        return (
            f"megapipe watchdog: {self.activity.where()}: the {phase} {ran} {elapsed:.1f} s, "
            f"past its bound of {bound:.1f} s ({why}); a peer is probably dead or stalled; "
            f"exiting with status {self.exit_status}"
        )

    def start(self) -> Watchdog:
        if self.settings.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megapipe-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            message = self.overdue()
            if message is not None and not self._stop.is_set():
                out = self.out or sys.stderr
                out.write(message + "\n")
                out.flush()
                sys.stdout.flush()
                os._exit(self.exit_status)
