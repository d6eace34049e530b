"""Graceful stop: with --exit-signal-handler, SIGTERM, SIGINT or the --exit-signal (SLURM's
SIGUSR1) reaching one rank mid-iteration makes every rank finish that iteration, save a
checkpoint there and exit 0; resuming from it prints the unstopped run's losses digit for
digit; a second signal ends the process at once with a non-zero status.

The signals are sent by the rank to itself at a named moment (MEGAPIPE_FAULT, training/
faults.py), so the iteration they arrive in is known.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megapipe.testing import run_distributed, train_with_flags
from megapipe.training.exit_conditions import SignalCatcher
from tests.elastic_launch import fork_job

FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0",
    "--train-iters", "6", "--pipeline-model-parallel-size", "2",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]  # fmt: skip
ELAPSED = re.compile(r" elapsed time per iteration \(ms\): [\d.]+ \|")
LOG = re.compile(r"^ iteration +(\d+)/")


def log_lines(stdout: str) -> dict[int, str]:
    """iteration -> its log line without the iteration time."""
    return {
        int(m[1]): ELAPSED.sub("", line) for line in stdout.splitlines() if (m := LOG.match(line))
    }


@pytest.mark.slow
def test_sigterm_under_torchrun_saves_exits_0_and_resumes_exactly(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = [*FLAGS, "--exit-signal-handler", "--save", str(save), "--save-interval", "1000"]
    job = fork_job(2, flags, {"OMP_NUM_THREADS": "1", "MEGAPIPE_FAULT": "term:backward:3:1"})
    status = job.wait(timeout=200)
    stdout, stderr = job.text("stdout"), job.text("stderr")
    assert status == 0, job.timeline()
    assert "exiting program after receiving SIGTERM, at iteration 3" in stdout
    assert "received SIGTERM: stopping after this iteration" in stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (save / "iter_0000003").is_dir()
    first = log_lines(stdout)
    assert sorted(first) == [1, 2, 3]

    (reference,) = run_distributed(train_with_flags, 2, FLAGS, timeout=240)[-1:]
    unstopped = log_lines(reference[1])
    resumed = run_distributed(train_with_flags, 2, FLAGS + ["--load", str(save)], timeout=240)
    second = log_lines(resumed[-1][1])
    assert sorted(second) == [4, 5, 6]
    assert {**first, **second} == unstopped


@pytest.mark.parametrize(
    ("fault", "flags", "name"),
    [("int:forward:2:0", [], "SIGINT"), ("usr1:forward:2:1", ["--exit-signal", "SIGUSR1"],
                                           "SIGUSR1")],
    ids=["SIGINT", "exit-signal-SIGUSR1"],
)  # fmt: skip
def test_sigint_and_the_exit_signal_stop_at_the_iteration_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, flags: list[str], name: str
) -> None:
    monkeypatch.setenv("MEGAPIPE_FAULT", fault)  # read by each forked rank's train()
    save = tmp_path / "ckpt"
    argv = FLAGS + flags + ["--exit-signal-handler", "--save", str(save)]
    outputs = run_distributed(train_with_flags, 2, argv, timeout=240)
    assert [len(results) for results, _ in outputs] == [2, 2]
    assert f"exiting program after receiving {name}, at iteration 2" in outputs[0][1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def _catch_twice(gap_s: float) -> None:
    catcher = SignalCatcher()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(gap_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2.5)  # the main thread blocked, as in a collective
    catcher.close()
    os._exit(0 if catcher.received == signal.SIGTERM else 1)


@pytest.mark.parametrize(
    ("gap_s", "status"), [(1.5, 128 + signal.SIGTERM), (0.2, 0)], ids=["second", "forwarded-copy"]
)
def test_a_second_signal_exits_at_once_but_a_forwarded_copy_does_not(gap_s, status) -> None:
    child = mp.get_context("fork").Process(target=_catch_twice, args=(gap_s,))
    start = time.monotonic()
    child.start()
    child.join(timeout=30)
    assert child.exitcode == status
    if status:
        assert time.monotonic() - start < gap_s + 1.5  # not the 2.5 s more it would have run
