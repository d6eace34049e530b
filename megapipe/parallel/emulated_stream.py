"""NCCL's ordering of point-to-point transfers, emulated on gloo (`--emulate-nccl-p2p-order`).

NCCL runs a communicator's transfers on one CUDA stream, one group call (`batch_isend_irecv`)
after the other, in posting order; gloo runs every posted transfer at once. An `EmulatedStream`
gives gloo that rule: a worker thread posts each batch once the one before it has completed,
and waits for it. Rendezvous is strict without further modelling: gloo's send completes only
once the peer has posted the matching receive (no eager buffering, even for one element), so a
posting order that would hang on NCCL hangs here too, until the stream's timeout turns it into
an error.

NCCL and CUDA promise less than a stream per communicator that progresses on its own
(nvidia/nccl#783, pytorch#113281); `NcclEmulation` adds each of the two rules the simulator
models (`pipeline/simulator.py`), by name:

- "handshake": connections are made lazily. A rank's first group call with a peer on a
  communicator blocks its host until the peer's host reaches its own first call with this rank
  there (here through the job's TCP store, as NCCL's bootstrap does it outside the stream).
- "one-queue": every communicator's group calls of a rank run in one posting order, on one
  emulated stream (the worst case CUDA allows: `CUDA_DEVICE_MAX_CONNECTIONS=1` funnels every
  stream into one hardware queue), and a collective waits until everything queued before it
  has completed (`collectives_behind_queue`).

Without either ("streams") each communicator has a stream of its own, the model before.

Users: the pipeline's transfers (`pipeline/p2p.py`) and the context-parallel ring
(`model/context_parallel_ring.py`). It sits in parallel/ because both import it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.config import NCCL_EMULATION_CHOICES, NCCL_RULES


@dataclass
class StreamBatch:
    """One batch of transfers queued on an emulated stream: done when all of them are."""

    ops: list[dist.P2POp]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the batch completed (RuntimeError on a failure, or after `timeout`)."""
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("the emulated NCCL stream did not reach or finish this transfer")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error

    @property
    def succeeded(self) -> bool:
        return self.done.is_set() and self.error is None


class EmulatedStream:
    """NCCL's rule for one communicator, on gloo: batches run one at a time, in posting order.

    A daemon thread posts each batch once the one before it has completed, and waits for it
    (each transfer at most `timeout`); after a failure (a timeout) every later batch fails too,
    as a broken NCCL communicator would. The thread lives as long as the process, as the
    device queue it stands for.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue[StreamBatch] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        threading.Thread(target=self._run, daemon=True, name="emulated-nccl-stream").start()

    def submit(self, ops: list[dist.P2POp]) -> StreamBatch:
        batch = StreamBatch(ops)
        self._queue.put(batch)
        return batch

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if self._failed is not None:
                    raise RuntimeError(f"an earlier transfer on this stream failed: {self._failed}")
                for work in dist.batch_isend_irecv(batch.ops):
                    work.wait(self.timeout)
                batch.ops = []  # let go of the tensors, as NCCL does once a transfer is done
            except BaseException as error:  # reported to whoever waits for this batch
                batch.error = self._failed = self._failed or error
            batch.done.set()


class NcclEmulation:
    """NCCL's rules for this process's point-to-point transfers, on gloo (module docstring).

    `submit(communicator, peers, ops)` queues one group call: with "handshake", the first call
    with each peer on `communicator` (a name every member agrees on) first blocks the host until
    that peer reaches its own first call here; with "one-queue" every call goes on the one
    stream of this process, otherwise on the communicator's own.
    """

    def __init__(self, rules: Iterable[str], timeout: timedelta) -> None:
        self.rules = frozenset(rules)
        unknown = self.rules - set(NCCL_EMULATION_CHOICES)
        if unknown:
            raise ValueError(f"unknown NCCL emulation rules {sorted(unknown)}")
        self.timeout = timeout
        self._streams: dict[str, EmulatedStream] = {}
        self._connected: set[tuple[str, int]] = set()
        self._pending: list[StreamBatch] = []
        if self.one_queue:  # a dispatch mode's first use imports torch._dynamo (2.7 s here):
            import torch._dynamo  # noqa: F401  # paid now, not inside the first timed step

    @property
    def one_queue(self) -> bool:
        return "one-queue" in self.rules

    def submit(self, communicator: str, peers: Iterable[int], ops: list[dist.P2POp]) -> StreamBatch:
        """Queue one group call of `ops` with global ranks `peers` on `communicator`."""
        if "handshake" in self.rules:
            self._handshake(communicator, sorted(set(peers)))
        key = "device" if self.one_queue else communicator
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = EmulatedStream(self.timeout)
        batch = stream.submit(ops)
        if self.one_queue:
            self._pending = [b for b in self._pending if not b.done.is_set()] + [batch]
        return batch

    def _handshake(self, communicator: str, peers: list[int]) -> None:
        new = [peer for peer in peers if (communicator, peer) not in self._connected]
        if not new:
            return
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        key = "megapipe-nccl-handshake/{}/{}-{}"
        for peer in new:
            store.set(key.format(communicator, me, peer), "1")
        try:
            store.wait([key.format(communicator, peer, me) for peer in new], self.timeout)
        except RuntimeError as error:  # the store's timeout: a peer never came
            raise RuntimeError(
                f"the connection handshake with global rank(s) {new} on communicator "
                f"{communicator} did not complete within {self.timeout.total_seconds():g} s "
                "(each peer's first transfer there never came: a hang on NCCL)"
            ) from error
        self._connected.update((communicator, peer) for peer in new)

    def drain(self) -> None:
        """one-queue: block until every group call queued so far has completed (what a
        collective queued behind them waits for); a failed or stuck one raises."""
        pending, self._pending = self._pending, []
        for batch in pending:
            batch.wait(self.timeout)

    @contextmanager
    def collectives_behind_queue(self) -> Iterator[None]:
        """one-queue: within this block every collective this thread runs (c10d's all-reduce,
        all-gather, reduce-scatter, all-to-all, broadcast, barrier, FSDP2's and DTensor's
        included) first waits for the group calls queued before it, as in one hardware queue."""
        if not self.one_queue:
            yield
            return
        with _DrainBeforeCollectives(self):
            yield


_POINT_TO_POINT = {"send", "recv_", "recv_any_source_"}


class _DrainBeforeCollectives(TorchDispatchMode):
    """Sees every c10d op dispatched on this thread; drains the queue before a collective."""

    def __init__(self, emulation: NcclEmulation) -> None:
        super().__init__()
        self.emulation = emulation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func._schema.name
        if op.startswith("c10d::") and op.removeprefix("c10d::") not in _POINT_TO_POINT:
            self.emulation.drain()
        return func(*args, **(kwargs or {}))


_PROCESS_EMULATIONS: dict[tuple[int, frozenset[str]], NcclEmulation] = {}


def process_emulation(rules: Iterable[str], timeout: timedelta) -> NcclEmulation:
    """This process's emulated device for `rules`: one rank per process, and one device queue
    that every user of the rank shares (the pipeline and the context-parallel ring), as the
    GPU's queue is shared; the first caller's timeout holds."""
    key = (os.getpid(), frozenset(rules))
    emulation = _PROCESS_EMULATIONS.get(key)
    if emulation is None:
        emulation = _PROCESS_EMULATIONS[key] = NcclEmulation(rules, timeout)
    return emulation


def emulation_rules(value: bool | Iterable[str]) -> frozenset[str]:
    """The rules a flag or argument value asks for: True (the bare flag) means every rule
    NCCL allows (NCCL_RULES); False or empty, none (no emulation)."""
    if value is True:
        return frozenset(NCCL_RULES)
    if value is False or value is None:
        return frozenset()
    return frozenset(value)
