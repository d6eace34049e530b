"""Automatic resume: a TP2 x PP2 job under torch's elastic agent (torchrun's machinery, see
elastic_launch.py) with --save and --load naming one directory, one of whose ranks is SIGKILLed
at each of five moments (mid-forward, mid-backward, mid-optimizer-step, mid-checkpoint-save,
during evaluation), restarts, resumes from the latest complete checkpoint by itself and prints
the losses of a run that was never killed, digit for digit.

One job runs all five kills, one per attempt (`MEGAPIPE_FAULT=...@attempt`), saving every
iteration, so that each attempt gets one iteration further; the unkilled reference is the same
flags run in-process. Both are module-scoped: every test reads the same two runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from megapipe.errors import ConfigError
from megapipe.testing import run_distributed, train_with_flags
from megapipe.training.faults import Fault, FaultPlan
from tests.elastic_launch import fork_job

TRAIN_ITERS = 8
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--lr", "3e-3", "--log-interval", "1",
    "--train-iters", str(TRAIN_ITERS), "--eval-interval", "3", "--eval-iters", "1",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--seed", "7",
]  # fmt: skip
# (moment, iteration, rank), attempt i kills at KILLS[i]; each resumes from the iteration before
KILLS = [("forward", 2, 1), ("backward", 3, 2), ("optimizer", 4, 3), ("save", 5, 1), ("eval", 6, 0)]
ELAPSED = re.compile(r" elapsed time per iteration \(ms\): [\d.]+ \|")
LOG = re.compile(r"^ iteration +(\d+)/")
VALID = re.compile(r"^ validation loss at iteration (\d+)( on \w+ set)? \| .*")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration +(\d+)")


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str


def numbers(stdout: str) -> list[str]:
    """The log and validation lines, without the (run-dependent) iteration time."""
    lines = [ELAPSED.sub("", line) for line in stdout.splitlines()]
    return [line for line in lines if LOG.match(line) or VALID.match(line)]


@pytest.fixture(scope="module")
def reference() -> list[str]:
    outputs = run_distributed(train_with_flags, 4, FLAGS, timeout=240)
    return numbers(outputs[-1][1])


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Path]:
    save = tmp_path_factory.mktemp("auto-resume") / "ckpt"
    faults = ",".join(f"kill:{m}:{i}:{r}@{a}" for a, (m, i, r) in enumerate(KILLS))
    flags = [*FLAGS, "--save", str(save), "--load", str(save), "--save-interval", "1"]
    env = {"OMP_NUM_THREADS": "1", "MEGAPIPE_FAULT": faults}
    job = fork_job(4, flags, env, max_restarts=len(KILLS))
    status = job.wait(timeout=200)  # ~20 s when quiet; within pytest's 300 s, to report it
    assert status != -9, f"the job did not end within 200 s; its last lines:\n{job.timeline()}"
    return Job(status, job.text("stdout"), job.text("stderr")), save


@pytest.mark.slow
def test_every_kill_fired_and_the_job_still_succeeded(killed_job) -> None:
    job, _ = killed_job
    assert job.returncode == 0, job.stderr[-3000:]
    for moment, iteration, rank in KILLS:
        line = f"MEGAPIPE_FAULT: kill rank {rank} at {moment} of iteration {iteration}"
        assert line in job.stderr, job.stderr[-3000:]


@pytest.mark.slow
def test_each_restart_resumed_from_the_latest_complete_checkpoint(killed_job) -> None:
    job, save = killed_job
    # the first attempt starts from scratch (an empty --load); each later one loads the
    # checkpoint of the iteration before the kill, and the one half-written by the rank
    # killed mid-save (iteration 5) is not it
    loaded = [int(m[1]) for m in map(LOADED.search, job.stdout.splitlines()) if m]
    assert loaded == [i - 1 for _, i, _ in KILLS]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    leftovers = [p.name for p in save.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


@pytest.mark.slow
def test_losses_after_each_resume_equal_the_unkilled_runs_digit_for_digit(
    killed_job, reference
) -> None:
    job, _ = killed_job
    printed = numbers(job.stdout)
    expected = {line: True for line in reference}
    assert [line for line in printed if line not in expected] == []
    # and the last attempt ran to the end: its lines are the reference's tail
    last_start = job.stdout.rindex("successfully loaded checkpoint")
    tail = numbers(job.stdout[last_start:])
    assert len(tail) >= 3 and tail == reference[-len(tail) :]
    iterations = {int(m[1]) for m in map(LOG.match, printed) if m}
    assert iterations == set(range(1, TRAIN_ITERS + 1))


@pytest.mark.slow
def test_survivors_name_the_operation_they_were_in(killed_job) -> None:
    job, _ = killed_job
    # a survivor's last words: its failed collective, or the launcher's SIGTERM if it came first
    errors = [line for line in job.stderr.splitlines() if line.startswith("megapipe: rank")]
    assert errors, job.stderr[-3000:]
    for line in errors:
        assert re.search(r"rank \d \(tp \d, pp \d, dp 0\), iteration \d+, \w+: in ", line), line
    assert any("receive from pipeline rank" in line for line in errors)


def test_fault_plans_parse_and_refuse_by_name() -> None:
    environ = {"MEGAPIPE_FAULT": "kill:backward:3:1, stop:eval:6:2@1"}
    assert FaultPlan.from_env(environ, rank=0) is None
    assert FaultPlan.from_env(environ, rank=2) is None  # planned for attempt 1
    plan = FaultPlan.from_env({**environ, "TORCHELASTIC_RESTART_COUNT": "1"}, rank=2)
    assert plan is not None and list(plan._pending.values()) == [Fault("stop", "eval", 6, 2, 1)]
    for text, message in (
        ("kill:backward:3", "expected action:moment:iteration:rank"),
        ("boom:backward:3:1", "action 'boom' is not one of kill, stop"),
        ("kill:lunch:3:1", "moment 'lunch' is not one of forward, backward"),
        ("kill:backward:x:1", "must be whole numbers"),
    ):
        with pytest.raises(ConfigError, match=message):
            FaultPlan.from_env({"MEGAPIPE_FAULT": text}, rank=1)
