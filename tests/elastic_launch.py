"""`python tests/elastic_launch.py --nproc 4 --max-restarts 1 -- <pretrain_gpt.py flags>`

Runs pretrain_gpt.py on CPU ranks under torch's elastic agent, the machinery `torchrun
--standalone --nproc_per_node N --max-restarts R` runs (the same agent, c10d rendezvous on a
free port, restarts, TORCHELASTIC_RESTART_COUNT and the teardown of the other ranks when one
fails), with one difference: the ranks are forked from a fork server that has imported torch
and megapipe once, instead of each attempt starting N new interpreters that import them again
(about 5 CPU-seconds per rank). That is what lets the fault tests restart a 4-rank job several
times within their CI budget; tools/stress_kill.py runs the real `torchrun` command.
Exits 0 when the job succeeded, 1 when it failed after its restarts (with torchrun's report).
Tests call `fork_job`, which forks the agent itself from the test process (megapipe is
imported there already), so one interpreter starts per job: the fork server.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (torch.optim's lazy import: 1.5 s in every rank else)
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

import megapipe.training  # noqa: E402, F401  (imported once, before the ranks are forked)
import pretrain_gpt  # noqa: E402


def _rank(argv: list[str]) -> None:
    """One rank: pretrain_gpt's main, its status as the process's exit status."""
    torch.set_num_threads(1)
    # one write per line, as the agent's own streams (the ranks share its pipes; the fork
    # server's streams, and even reconfigure(line_buffering=True), write a line's text and its
    # newline apart, so another rank's line could land in between)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    status = pretrain_gpt.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if status:
        sys.exit(status)


def launch(
    nproc: int, flags: list[str], *, max_restarts: int = 0, shutdown_timeout: int = 30
) -> int:
    """Run pretrain_gpt.py <flags> on `nproc` forked ranks under the elastic agent; 0 when the
    job succeeded, 1 when it failed after its restarts (torchrun's report on stderr)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
        shutdown_timeout=shutdown_timeout,
    )
    # Ranks come from a fork server, not from the agent: the agent has threads (its store's
    # server, the rendezvous keep-alive), and a rank forked while one of them held glibc's
    # resolver lock (the store formats each new peer's address with getnameinfo) inherits it
    # locked, and then waits forever in its own first lookup (seen in CI: one rank of a restart
    # stuck creating its TCPStore client, the others waiting for it). The fork server is a
    # single-threaded process that imports torch and megapipe once; each attempt's ranks are
    # forked from it, as cheap as forking from the agent.
    multiprocessing.set_forkserver_preload([__name__])
    sys.stdout.flush()
    try:
        elastic_launch(config, _rank)(flags)
    except ChildFailedError as error:
        sys.stderr.write(error.format_msg() + "\n")
        return 1
    return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _is_fork_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.forkserver" in f.read()
    except FileNotFoundError:
        return False


@dataclass
class ForkedJob:
    """A `launch` running in a child forked from the caller (a test that imported megapipe
    already): its agent's pid, and its output lines as they arrived."""

    pid: int
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (time, stream, text)
    readers: list[threading.Thread] = field(default_factory=list)
    status: int | None = None

    def ranks(self) -> list[int]:
        """The rank processes alive now: the children of the agent's fork server (the agent's
        other child is multiprocessing's resource tracker)."""
        return [rank for child in _children(self.pid) if _is_fork_server(child)
                for rank in _children(child)]  # fmt: skip

    def wait(self, timeout: float) -> int:
        """The launch's status (-9 when it was killed after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                for rank in self.ranks():  # orphaned ranks would hold the cores for minutes
                    os.kill(rank, signal.SIGKILL)
                os.kill(self.pid, signal.SIGKILL)
                deadline = float("inf")
            else:
                time.sleep(0.05)
        for reader in self.readers:
            reader.join(timeout=10)
        return self.status

    def text(self, stream: str) -> str:
        return "".join(line for _, s, line in self.lines if s == stream)

    def timeline(self, last: int = 40) -> str:
        """The last `last` lines of both streams, each with its arrival time (s from the
        first line): what a test prints when the job did not end in time."""
        if not self.lines:
            return "(no output)"
        start = self.lines[0][0]
        return "".join(f"{t - start:8.2f} {s}: {line}" for t, s, line in self.lines[-last:])


def fork_job(nproc: int, flags: list[str], env: dict[str, str], **options: int) -> ForkedJob:
    """Start `launch(nproc, flags, **options)` in a forked child with `env` added to its
    environment; its stdout and stderr are collected line by line, with arrival times."""
    pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the agent, its ranks forked from it in turn
        status = 1
        try:
            for fd, (read, write) in zip((1, 2), pipes.values()):
                os.dup2(write, fd)
                os.close(read)
                os.close(write)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name, None)
            os.environ.update(env)
            status = launch(nproc, flags, **options)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    job = ForkedJob(pid)
    for name, (read, write) in pipes.items():
        os.close(write)

        def collect(read: int = read, name: str = name) -> None:
            with open(read, encoding="utf-8", errors="replace") as stream:
                for line in stream:
                    job.lines.append((time.monotonic(), name, line))

        job.readers.append(threading.Thread(target=collect, daemon=True))
        job.readers[-1].start()
    return job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=int, default=30)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    return launch(
        args.nproc, flags, max_restarts=args.max_restarts, shutdown_timeout=args.shutdown_timeout
    )


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the interpreter's teardown of torch (seconds, after the job ended)
