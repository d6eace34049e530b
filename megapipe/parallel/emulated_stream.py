"""NCCL's ordering of point-to-point transfers, emulated on gloo (`--emulate-nccl-p2p-order`).

NCCL runs a communicator's transfers on one CUDA stream, one group call (`batch_isend_irecv`)
after the other, in posting order; gloo runs every posted transfer at once. An `EmulatedStream`
gives gloo NCCL's rule for one communicator: a worker thread posts each batch once the one
before it has completed, and waits for it. Rendezvous is strict without further modelling:
gloo's send completes only once the peer has posted the matching receive (no eager buffering,
even for one element), so a posting order that would hang on NCCL hangs here too, until the
stream's timeout turns it into an error.

Users: the pipeline's transfers (`pipeline/p2p.py`, one stream per link group) and the
context-parallel ring (`model/context_parallel_ring.py`, one stream per communicator NCCL
would use). It sits in parallel/ because both import it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


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


_CLOSE = None  # queued by `close`: the worker ends after the batches before it


class EmulatedStream:
    """NCCL's rule for one communicator, on gloo: batches run one at a time, in posting order.

    A daemon thread posts each batch once the one before it has completed, and waits for it
    (each transfer at most `timeout`); after a failure (a timeout) every later batch fails too,
    as a broken NCCL communicator would. `close` ends the thread once the queue is run dry.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue[StreamBatch | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        threading.Thread(target=self._run, daemon=True, name="emulated-nccl-stream").start()

    def submit(self, ops: list[dist.P2POp]) -> StreamBatch:
        batch = StreamBatch(ops)
        self._queue.put(batch)
        return batch

    def close(self) -> None:
        """Let the worker thread end after the batches already queued."""
        self._queue.put(_CLOSE)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not _CLOSE:
            try:
                if self._failed is not None:
                    raise RuntimeError(f"an earlier transfer on this stream failed: {self._failed}")
                for work in dist.batch_isend_irecv(batch.ops):
                    work.wait(self.timeout)
                batch.ops = []  # let go of the tensors, as NCCL does once a transfer is done
            except BaseException as error:  # reported to whoever waits for this batch
                batch.error = self._failed = self._failed or error
            batch.done.set()
