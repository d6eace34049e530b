"""What this rank is doing right now: the record the watchdog reads and fault plans fire on.

The training loop marks phases (`begin("step", 5)`, `begin("evaluation", 5)`, ...); the
executor, the p2p communicator and the gradient buffers mark the operation they are about to
wait in (`enter("recv", "receive of {} from pipeline rank {}", ...)`). An `enter` costs a tuple
assignment and a clock read: the message is formatted only when someone reports it (the
watchdog, or an error naming where a rank was when its peer vanished). Writes are single
attribute assignments, so the watchdog thread always reads a consistent record.

Components that wait receive the Activity as an argument (never a global); each defaults to
its own idle record, so code built without one (tests, tools) behaves as before. The module
sits at the package's top because pipeline/ and distributed/, which training/ imports, use it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from megapipe.errors import ContextParallelCommError, PipelineCommError, RankFailure

if TYPE_CHECKING:
    from megapipe.parallel.state import ParallelState

STEP_HISTORY = 50  # step times the watchdog's median is taken over
_COMPUTE_MOMENTS = ("forward", "backward", "weight-grad", "eval")


class FaultHook(Protocol):
    """What an Activity fires planned faults through (training.faults.FaultPlan: training/
    sits above this module, so it is named by what it does, not imported)."""

    def at(self, moment: str, iteration: int) -> None: ...


class Activity:
    """This rank's current phase and operation, its recent step times, and its fault plan."""

    def __init__(self, state: ParallelState | None = None, faults: FaultHook | None = None) -> None:
        self.state = state
        self.faults = faults
        now = time.monotonic()
        self.iteration = 0
        self.phase: tuple[str, int, float] = ("start-up", 0, now)
        self.current: tuple[str, str, tuple, float] = ("start-up", "start-up", (), now)
        self.step_seconds: deque[float] = deque(maxlen=STEP_HISTORY)

    def begin(self, phase: str, iteration: int) -> None:
        """Start `phase` ("step", "evaluation", "save", "done", ...) of `iteration`; a
        finished step's duration joins the history."""
        now = time.monotonic()
        name, _, since = self.phase
        if name == "step":
            self.step_seconds.append(now - since)
        self.iteration = iteration
        self.phase = (phase, iteration, now)
        self.current = (phase, phase, (), now)

    def enter(self, moment: str, what: str, *args: object) -> None:
        """About to run or wait in `what.format(*args)`; fires a planned fault for `moment`."""
        self.current = (moment, what, args, time.monotonic())
        if self.faults is not None:
            self.faults.at(moment, self.iteration)

    def median_step_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def operation(self) -> str:
        """The operation entered last, e.g. `receive of F2.0 from pipeline rank 0 (global
        rank 1)`, with the tensor- and context-parallel peers of a compute that runs their
        collectives."""
        moment, what, args, _ = self.current
        text = what.format(*args)
        state = self.state
        if moment in _COMPUTE_MOMENTS and state is not None and state.tp.size > 1:
            text += f", in its tensor-parallel collectives with ranks {list(state.tp.ranks)}"
        if moment in _COMPUTE_MOMENTS and state is not None and state.cp.size > 1:
            text += f", in its context-parallel attention with ranks {list(state.cp.ranks)}"
        return text

    def where(self) -> str:
        """`rank 3 (tp 1, pp 1, dp 0), iteration 5, step: <operation> (for 2.1 s)`."""
        now = time.monotonic()
        phase, iteration, _ = self.phase
        since = self.current[3]
        who = "this rank"
        if self.state is not None:
            s = self.state
            cp = f", cp {s.cp_rank}" if s.cp.size > 1 else ""
            who = f"rank {s.rank} (tp {s.tp_rank}{cp}, pp {s.pp_rank}, dp {s.dp_rank})"
        return (
            f"{who}, iteration {iteration}, {phase}: in {self.operation()} "
            f"(for {now - since:.1f} s)"
        )

    def failure(self, error: BaseException) -> RankFailure:
        """A one-line error saying where this rank was when a collective failed under it."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RankFailure(
            f"{self.where()}: a peer failed or timed out ({first}); "
            "the job must be restarted (torchrun --max-restarts resumes from the last checkpoint)"
        )


def is_communication_failure(error: BaseException) -> bool:
    """A collective or transfer error (a peer died, a timeout), not a bug in this rank."""
    if isinstance(error, (dist.DistError, PipelineCommError, ContextParallelCommError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection reset", "Connection closed")
    )
