"""When training stops early: --exit-interval, --exit-duration-in-mins, and a signal (SIGTERM,
SIGINT or --exit-signal) with --exit-signal-handler.

Every rank must stop after the same iteration, or the ones that go on hang in their next
collective. The interval is the same on every rank by construction; the elapsed time and a
received signal are not (a signal may reach one rank only, clocks drift), so they are combined
with one MAX all-reduce over the world group after each iteration, and only when one of those
flags is set (otherwise no communication is added).

A signal is noticed by a small thread through Python's wakeup fd, not only by the Python-level
handler: the handler runs on the main thread between bytecodes, which a rank blocked in a
collective never reaches, while the wakeup fd is written by the C-level handler at once. That
is what lets a second signal (more than `DEBOUNCE_S` after the first, so the copy a launcher
forwards does not count) end the process immediately, with status 128 + the signal's number.
Without --exit-signal-handler, a SIGTERM (torchrun tearing the job down after a rank failed)
ends the rank at once as before, after one line saying what it was waiting in.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.activity import Activity
from megapipe.config import TrainingConfig
from megapipe.console import say
from megapipe.parallel.state import ParallelState

DEBOUNCE_S = 1.0  # a repeat within this long is the same request (torchrun forwards signals)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _SignalThread:
    """Calls `on_signal(signum)` on a thread as soon as one of `signums` arrives (through the
    wakeup fd; from the Python-level handler when this is not the main thread). Restores the
    previous handlers and wakeup fd on close."""

    def __init__(self, signums: Iterable[int], on_signal: Callable[[int], None]) -> None:
        self.signums = tuple(dict.fromkeys(int(s) for s in signums))
        self.on_signal = on_signal
        self._previous = {s: signal.signal(s, self._handle) for s in self.signums}
        self._old_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the Python-level handler alone notices
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._watch, name="megapipe-signals", daemon=True)
        self._thread.start()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self._thread is None:
            self.on_signal(signum)

    def _watch(self) -> None:
        assert self._pipe is not None
        while data := os.read(self._pipe[0], 64):
            for signum in data:
                if signum in self.signums:
                    self.on_signal(signum)

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            read, write = self._pipe
            os.close(write)  # the watching thread reads end-of-file and returns
            if self._thread is not None:
                self._thread.join(timeout=1.0)
            os.close(read)
            self._pipe = None


class SignalCatcher:
    """Records the first of `signums` instead of dying of it; a second one, later than
    DEBOUNCE_S, exits at once. Restores the previous handlers on close."""

    def __init__(self, signums: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.received: int | None = None  # the first signal's number
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._thread = _SignalThread(signums, self.note)

    def note(self, signum: int) -> None:
        """A signal arrived: the first asks to stop after this iteration, a later one exits."""
        with self._lock:
            now = time.monotonic()
            if self.received is None:
                self.received, self._first_at = signum, now
                say(
                    f"received {signal_name(signum)}: stopping after this iteration, with a "
                    "checkpoint when --save is set (a second signal exits at once)"
                )
            elif now - self._first_at > DEBOUNCE_S:
                say(f"received {signal_name(signum)} again: exiting at once")
                os._exit(128 + signum)

    def close(self) -> None:
        self._thread.close()


class TeardownReport:
    """Without --exit-signal-handler: a SIGTERM (torchrun stopping the job because another
    rank failed) still ends the rank at once, after one line saying where it was."""

    def __init__(self, activity: Activity) -> None:
        self.activity = activity
        self._thread = _SignalThread((signal.SIGTERM,), self._report)

    def _report(self, signum: int) -> None:
        say(
            f"megapipe: {self.activity.where()}: terminated by {signal_name(signum)} (the "
            "launcher stopping the job, e.g. after another rank failed)"
        )
        os._exit(128 + signum)

    def close(self) -> None:
        self._thread.close()


@dataclass
class ExitCheck:
    """Decides, identically on every rank, whether to stop after an iteration."""

    training: TrainingConfig
    state: ParallelState
    start_time: float
    catcher: SignalCatcher | TeardownReport | None = None
    activity: Activity | None = None

    @classmethod
    def start(
        cls, training: TrainingConfig, state: ParallelState, activity: Activity | None = None
    ) -> ExitCheck:
        catcher: SignalCatcher | TeardownReport | None = None
        if training.exit_signal_handler:
            catcher = SignalCatcher((signal.SIGTERM, signal.SIGINT, training.exit_signal))
        elif activity is not None and threading.current_thread() is threading.main_thread():
            catcher = TeardownReport(activity)  # (only the main thread may install handlers)
        return cls(training, state, time.monotonic(), catcher, activity)

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (1-based), or None to go on. Collective when the
        duration or signal flags are set: call it on every rank after every iteration."""
        training = self.training
        received, duration = 0, False
        catcher = self.catcher if isinstance(self.catcher, SignalCatcher) else None
        if catcher is not None or training.exit_duration_in_mins is not None:
            minutes = (time.monotonic() - self.start_time) / 60.0
            flags = torch.tensor(
                [
                    float(catcher.received or 0) if catcher is not None else 0.0,
                    float(
                        training.exit_duration_in_mins is not None
                        and minutes > training.exit_duration_in_mins
                    ),
                ],
                device=self.state.device,
            )
            if self.state.world_size > 1:
                if self.activity is not None:
                    what = "the end-of-iteration agreement on stopping (all-reduce, all ranks)"
                    self.activity.enter("step-end", what)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.state.world.pg)
            received, duration = int(flags[0]), bool(flags[1])
        if received:
            return (
                f"exiting program after receiving {signal_name(received)}, at iteration {iteration}"
            )
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
