"""Run a function on N gloo ranks on the CPU: the harness every multi-rank test uses.

Ranks are forked (0.2 s for 8 ranks, against ~15 s to spawn), each sets one intra-op thread
first (forked children can otherwise hang in OpenMP) and joins a gloo group through a private
`file://` rendezvous, so concurrent tests never clash on ports. A rank that raises fails the
call with that rank's traceback; a rank that hangs or dies fails it after `timeout` seconds,
naming the ranks that did not finish, instead of hanging the test run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from megapipe.errors import MegapipeError

# When one rank fails, give its peers a moment to report their own error, then stop waiting.
_FAILURE_GRACE_S = 2.0


class DistributedTestError(MegapipeError, RuntimeError):
    """One or more ranks failed, died or timed out."""


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    results: mp.Queue,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    timeout: float,
) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    # A precaution (no hang was seen here): gloo's default device looks the host name up
    # (getaddrinfo), and a rank forked while another thread of the parent held glibc's resolver
    # lock would wait on it forever, as tests/elastic_launch.py's ranks did. The loopback
    # interface by name needs no lookup (all ranks are on this host).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` forked gloo ranks.

    Returns the per-rank return values (picklable), in rank order.
    """
    ctx = mp.get_context("fork")
    workdir = tempfile.mkdtemp(prefix="megapipe-rdzv-")
    init_file = os.path.join(workdir, "rendezvous")
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            name=f"rank{r}",
            args=(r, world_size, init_file, results, fn, args, kwargs, timeout),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if first_failure_at is not None and now > first_failure_at + _FAILURE_GRACE_S:
                break  # peers of a failed rank are usually blocked in a collective
            if now > deadline:
                missing = sorted(set(range(world_size)) - set(values) - set(failures))
                failures.update({r: f"rank {r} timed out after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in values and r not in failures and p.exitcode not in (None, 0):
                        failures[r] = f"rank {r} died with exit code {p.exitcode}"
                        first_failure_at = first_failure_at or time.monotonic()
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                first_failure_at = first_failure_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        first = next(iter(failures))  # the earliest report is usually the root cause
        others = ", ".join(str(r) for r in sorted(failures) if r != first)
        extra = f" (ranks {others} also failed)" if others else ""
        raise DistributedTestError(
            f"{len(failures)} of {world_size} ranks failed{extra}; rank {first}:\n{failures[first]}"
        )
    return [values[r] for r in range(world_size)]


def train_with_flags(rank: int, world_size: int, argv: list[str]) -> tuple[list, str]:
    """One rank of `pretrain_gpt.py <argv>`, in-process: (per-iteration StepResults, stdout).

    For `run_distributed(train_with_flags, world_size, argv)`: every parity test of the training
    product drives the same code path as the command line.
    """
    import contextlib
    import io

    from megapipe.arguments import parse_args
    from megapipe.parallel.state import ParallelState
    from megapipe.training import train

    configs = parse_args(argv, world_size)
    parallel = configs.parallel
    state = ParallelState.build(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        data_parallel_instances=configs.optimizer.num_distributed_optimizer_instances,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = train(configs, state)
    return results, out.getvalue()
