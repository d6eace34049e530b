"""When training stops early: --exit-interval, --exit-duration-in-mins, and SIGTERM with
--exit-signal-handler.

Every rank must stop after the same iteration, or the ones that go on hang in their next
collective. The interval is the same on every rank by construction; the elapsed time and a
received signal are not (a signal may reach one rank only, clocks drift), so they are combined
with one MAX all-reduce over the world group after each iteration, and only when one of those
flags is set (otherwise no communication is added).
"""

from __future__ import annotations

import signal
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.config import TrainingConfig
from megapipe.parallel.state import ParallelState


class SignalCatcher:
    """Records that a signal arrived instead of dying of it; restores the old handler on close."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = True

    def close(self) -> None:
        signal.signal(self.signum, self._previous)


@dataclass
class ExitCheck:
    """Decides, identically on every rank, whether to stop after an iteration."""

    training: TrainingConfig
    state: ParallelState
    start_time: float
    catcher: SignalCatcher | None = None

    @classmethod
    def start(cls, training: TrainingConfig, state: ParallelState) -> ExitCheck:
        catcher = SignalCatcher() if training.exit_signal_handler else None
        return cls(training, state, time.monotonic(), catcher)

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (1-based), or None to go on. Collective when the
        duration or signal flags are set: call it on every rank after every iteration."""
        training = self.training
        received = duration = False
        if self.catcher is not None or training.exit_duration_in_mins is not None:
            minutes = (time.monotonic() - self.start_time) / 60.0
            flags = torch.tensor(
                [
                    float(self.catcher is not None and self.catcher.received),
                    float(
                        training.exit_duration_in_mins is not None
                        and minutes > training.exit_duration_in_mins
                    ),
                ],
                device=self.state.device,
            )
            if self.state.world_size > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.state.world.pg)
            received, duration = bool(flags[0]), bool(flags[1])
        if received:
            return f"exiting program after receiving SIGTERM, at iteration {iteration}"
        if duration:
            return (
                f"exiting program after {training.exit_duration_in_mins} minutes "
                f"(--exit-duration-in-mins), at iteration {iteration}"
            )
        if training.exit_interval is not None and iteration % training.exit_interval == 0:
            return f"exiting program at iteration {iteration} (--exit-interval)"
        return None

    def close(self) -> None:
        if self.catcher is not None:
            self.catcher.close()
