"""Fault injection for reliability tests: kill or stop this rank at a named moment.

A plan is data, read once at start-up from the environment variable MEGAPIPE_FAULT and handed
to the training loop (inside its `Activity`), never a patch of the code under test:

    MEGAPIPE_FAULT="kill:backward:3:1"            SIGKILL rank 1 in iteration 3's first backward
    MEGAPIPE_FAULT="kill:save:4:0@1,stop:eval:6:2"  several faults; `@N` = on restart N only

Each fault is `action:moment:iteration:rank[@attempt]`. Actions send a signal to this very
process: kill (SIGKILL), stop (SIGSTOP: a stall), term (SIGTERM), int (SIGINT), usr1 (SIGUSR1).
A fault fires once, the first time its moment is reached in its iteration, and only in the
attempt it names (default 0: torchrun's first start; TORCHELASTIC_RESTART_COUNT says which
attempt this is), so the restarted job runs clean. Moments are the points the loop, the
executor, the gradient buffers and the checkpoint save pass through (`MOMENTS`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from megapipe.console import say
from megapipe.errors import ConfigError

ENV_VAR = "MEGAPIPE_FAULT"
ACTIONS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "term": signal.SIGTERM,
    "int": signal.SIGINT,
    "usr1": signal.SIGUSR1,
}
# forward / backward: a training micro-batch's compute (executor); weight-grad: a zero-bubble
# schedule's W (the weight gradients its B deferred); eval: an evaluation micro-batch's
# forward; grad-reduce: waiting for a DP gradient bucket (DP > 1 only); optimizer: inside the
# optimizer step, after the local update and before the updated parameters are gathered;
# save: a checkpoint save, before this rank writes its shards.
# Each fires at the moment's first occurrence in the iteration.
MOMENTS = ("forward", "backward", "weight-grad", "eval", "grad-reduce", "optimizer", "save")


@dataclass(frozen=True)
class Fault:
    """One planned signal: `action` at the first `moment` of `iteration` on `rank`."""

    action: str
    moment: str
    iteration: int
    rank: int
    attempt: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        where = f"{ENV_VAR}={text!r}"
        body, _, attempt = text.strip().partition("@")
        parts = body.split(":")
        if len(parts) != 4:
            raise ConfigError(f"{where}: expected action:moment:iteration:rank[@attempt]")
        action, moment, iteration, rank = parts
        if action not in ACTIONS:
            raise ConfigError(f"{where}: action {action!r} is not one of {', '.join(ACTIONS)}")
        if moment not in MOMENTS:
            raise ConfigError(f"{where}: moment {moment!r} is not one of {', '.join(MOMENTS)}")
        numbers = (iteration, rank, attempt or "0")
        if not all(n.isdigit() for n in numbers):
            raise ConfigError(f"{where}: iteration, rank and attempt must be whole numbers")
        return cls(action, moment, *map(int, numbers))


class FaultPlan:
    """The faults meant for this rank in this attempt; `at` fires them."""

    def __init__(self, faults: list[Fault]) -> None:
        self._pending = {(f.moment, f.iteration): f for f in faults}

    @classmethod
    def from_env(cls, environ: Mapping[str, str], rank: int) -> FaultPlan | None:
        """The plan MEGAPIPE_FAULT describes for `rank` in this attempt; None when empty."""
        text = environ.get(ENV_VAR, "").strip()
        if not text:
            return None
        attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        faults = [Fault.parse(part) for part in text.split(",") if part.strip()]
        mine = [f for f in faults if f.rank == rank and f.attempt == attempt]
        return cls(mine) if mine else None

    def at(self, moment: str, iteration: int) -> None:
        """Called at each named moment: fire the fault planned for it, if any (once)."""
        fault = self._pending.pop((moment, iteration), None)
        if fault is None:
            return
        say(
            f"{ENV_VAR}: {fault.action} rank {fault.rank} at {moment} of iteration {iteration} "
            f"(pid {os.getpid()})"
        )
        os.kill(os.getpid(), ACTIONS[fault.action])
