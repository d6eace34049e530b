"""No hang lasts: when one rank stalls (SIGSTOP) or dies (SIGKILL) mid-step, in a tensor-parallel
group, as a pipeline neighbour or in a data-parallel group, every rank is gone within the bound
and the survivors' last words name the operation they were waiting in (and the peer, where
known).

Jobs run under torch's elastic agent (torchrun's machinery, tests/elastic_launch.py): the
watchdog ends a step after 5 x its median time, at least 8 s; the agent's shutdown grace is
15 s (the stopped rank cannot act on SIGTERM, so the agent SIGKILLs it after that).
A dead peer is noticed at once (gloo sees the connection reset); a stalled one by the
watchdog. The six jobs run concurrently (they mostly wait), in one module-scoped fixture.

The bounds are generous on purpose: the fault fires at a named moment (an event, not a time),
and nothing before it may time out on a loaded machine (2 cores, 12 ranks, other work): a
step before the fault must not trip the watchdog (a 3 s minimum did), the survivor must
have time to print its last words between the agent's SIGTERM and its SIGKILL (2 s did not),
and the ranks' store connections get the 5-minute distributed timeout (1 minute ran out
while six jobs started at once).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import pytest

from megapipe.testing import run_distributed
from tests.elastic_launch import ForkedJob, fork_job

WATCHDOG_MIN_S, WATCHDOG_FACTOR, SHUTDOWN_S = 8.0, 5.0, 15
SURVIVORS_S = 40.0  # fault -> the survivors' last words: the watchdog's bound, with room for load
AGENT_GRACE_S = 30.0  # > SHUTDOWN_S: torchrun SIGKILLs a rank that ignored its SIGTERM after it
JOB_WAIT_S = 420  # each job's end, from its wait (pytest's timeout here: 600, set below)
pytestmark = pytest.mark.timeout(600)
MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0",
    "--train-iters", "50", "--distributed-timeout-minutes", "5", "--pipeline-p2p-timeout", "300",
    "--watchdog-min-seconds", str(WATCHDOG_MIN_S), "--watchdog-timeout-factor",
    str(WATCHDOG_FACTOR),
]  # fmt: skip
# group -> (layout of a 2-rank job, fault moment, victim rank, what a survivor must name)
CASES = {
    "tp": (["--tensor-model-parallel-size", "2"], "backward", 1,
           "in its tensor-parallel collectives with ranks [0, 1]"),
    "pp": (["--pipeline-model-parallel-size", "2"], "forward", 1,
           "pipeline rank 1 (global rank 1)"),
    "dp": ([], "backward", 1,
           "all-reduce of gradient bucket 0 over the data-parallel group (ranks [0, 1])"),
}  # fmt: skip
LAST_WORDS = ("megapipe watchdog: rank", "megapipe: rank")
FAULT_LINE = re.compile(r"MEGAPIPE_FAULT: (\w+) rank (\d+) at .* \(pid (\d+)\)")


@dataclass
class Ended:
    returncode: int
    stderr: list[tuple[float, str]]  # (arrival time, line)
    ranks_gone_at: float  # when the launcher had no rank process left (after the fault)
    timeline: str = ""  # both streams' last lines with arrival times, for failure messages

    def fault(self) -> tuple[float, int]:
        """When the fault fired, and the victim's pid."""
        for at, line in self.stderr:
            if m := FAULT_LINE.search(line):
                return at, int(m[3])
        raise AssertionError("the fault never fired:\n" + self.text()[-3000:])

    def text(self) -> str:
        return "\n".join(line for _, line in self.stderr)


def _start(group: str, action: str) -> ForkedJob:
    layout, moment, victim, _ = CASES[group]
    env = {"OMP_NUM_THREADS": "1", "MEGAPIPE_FAULT": f"{action}:{moment}:4:{victim}"}
    return fork_job(2, [*MODEL, *layout], env, shutdown_timeout=SHUTDOWN_S)


def _stderr(job: ForkedJob) -> list[tuple[float, str]]:
    return [(t, line.rstrip("\n")) for t, stream, line in job.lines if stream == "stderr"]


def _ranks_gone(job: ForkedJob) -> float:
    """Poll the agent's child processes (its ranks) until, after the fault, none is left."""
    while True:
        fired = any(FAULT_LINE.search(line) for _, line in _stderr(job))
        if fired and not job.ranks() or job.status is not None:
            return time.monotonic()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ended() -> dict[tuple[str, str], Ended]:
    started = {(g, a): _start(g, a) for g in CASES for a in ("stop", "kill")}
    gone: dict[tuple[str, str], float] = {}
    watchers = [
        threading.Thread(target=lambda k=k, j=j: gone.update({k: _ranks_gone(j)}))
        for k, j in started.items()
    ]
    for watcher in watchers:
        watcher.start()
    statuses = {key: job.wait(timeout=JOB_WAIT_S) for key, job in started.items()}
    for watcher in watchers:
        watcher.join()
    return {
        key: Ended(statuses[key], _stderr(job), gone[key], job.timeline(80))
        for key, job in started.items()
    }


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # an unreaped orphan is gone too
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("action", ["stop", "kill"], ids=["stalled-SIGSTOP", "killed-SIGKILL"])
@pytest.mark.parametrize("group", list(CASES), ids=["tp-group", "pp-neighbour", "dp-group"])
def test_every_rank_is_gone_in_time_and_survivors_name_the_operation(
    ended, group: str, action: str
) -> None:
    job = ended[(group, action)]
    fired_at, victim_pid = job.fault()
    assert job.returncode != 0
    _, _, victim, names = CASES[group]
    # each survivor's last line: its watchdog (a stall), its peer's connection reset (a death),
    # or the agent's SIGTERM once another survivor had exited, whichever came first
    said = [(t, line) for t, line in job.stderr if line.startswith(LAST_WORDS)]
    assert all(", iteration 4, step: in " in line for _, line in said), said
    watchdog = [line for _, line in said if line.startswith("megapipe watchdog:")]
    assert all("exiting with status 3" in line for line in watchdog)
    assert bool(watchdog) == (action == "stop")  # a dead peer is noticed before any bound
    lines = [line for _, line in said]
    assert lines, job.timeline  # a survivor that said nothing: every line of both streams
    assert not any(re.search(rf"\brank {victim} \(tp", line.split(", iter")[0]) for line in lines)
    # a dead peer: the survivor names the collective it waited in, unless the launcher's
    # SIGTERM (sent once it saw the victim die) reached it while it was still computing (a
    # race the load decides); then it names that computation, of the same iteration
    stopped_first = action == "kill" and all("terminated by SIGTERM" in line for line in lines)
    assert any(names in line for line in lines) or stopped_first, "\n".join(lines)
    survivors = max(t for t, _ in said) - fired_at
    assert survivors < SURVIVORS_S, f"{survivors:.1f} s\n{job.text()[-3000:]}"
    took = job.ranks_gone_at - fired_at
    bound = survivors + (AGENT_GRACE_S if action == "stop" else 0.0) + SURVIVORS_S
    assert took < bound, f"{took:.1f} s\n{job.text()[-3000:]}"
    assert _gone(victim_pid)
    print(f"{group} {action}: survivors out {survivors:.1f} s, every rank {took:.1f} s after")


def _group_timeouts(rank: int, world_size: int) -> dict[str, float]:
    import torch

    from megapipe.parallel.state import ParallelState

    state = ParallelState.build(2, 1)
    groups = {"tp": state.tp.pg, "world": state.world.pg, "model_parallel": state.model_parallel.pg}
    cpu = torch.device("cpu")
    return {k: g._get_backend(cpu).options._timeout.total_seconds() for k, g in groups.items()}


def test_every_subgroup_has_the_default_groups_timeout() -> None:
    # run_distributed's default group times out after 37 s; torch's new_group would give 1800
    timeouts = run_distributed(_group_timeouts, 2, timeout=37)
    assert timeouts == [{"tp": 37.0, "world": 37.0, "model_parallel": 37.0}] * 2


def test_the_watchdog_times_steps_whole_and_other_phases_by_their_progress() -> None:
    from megapipe.activity import Activity
    from megapipe.training.watchdog import Watchdog, WatchdogSettings

    activity = Activity()
    watchdog = Watchdog(activity, WatchdogSettings(factor=5.0, min_seconds=3.0, max_seconds=10.0))
    activity.begin("step", 1)
    start = activity.phase[2]
    assert watchdog.overdue(start + 9.0) is None  # no median yet: the 10 s bound
    assert "the step has made no progress for 10.5 s" in watchdog.overdue(start + 10.5)
    activity.step_seconds.extend([1.0, 1.0, 2.0])  # median 1 s: 5 s bound from the step's start
    activity.enter("recv", "receive from pipeline rank {}", 1)
    assert watchdog.overdue(start + 4.9) is None
    late = watchdog.overdue(start + 5.1)
    assert "the step has run 5.1 s, past its bound of 5.0 s (5 x the median step time 1.00" in late
    assert "in receive from pipeline rank 1" in late
    activity.begin("evaluation", 1)
    begun = activity.phase[2]
    for batch in range(30):  # 30 batches of 1 s: far past 10 s in all, but progressing
        activity.current = ("eval", "forward of micro-batch {}", (batch,), begun + batch)
        assert watchdog.overdue(begun + batch + 1.0) is None
    stuck = watchdog.overdue(begun + 29 + 11.0)
    assert "the evaluation has made no progress for 11.0 s" in stuck
