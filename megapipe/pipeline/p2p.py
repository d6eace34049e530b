"""Point-to-point transfers between pipeline stages: one batch_isend_irecv per `Comm` action.

Each receive is waited on just before the compute that needs it; sends are left in flight and
waited on once the next batch is posted (posting first, so that a receive the peer's send
waits for is never held back behind this rank's own wait), so a rank computes while its
activations travel.
Shapes are known from the config, so there is no per-micro-batch shape handshake. A receive
that does not complete within the timeout raises an error naming the peer, instead of leaving
the rank waiting forever for a stage that died.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megapipe.activity import Activity
from megapipe.parallel.state import Group
from megapipe.pipeline.schedules import P2P


class PipelineCommError(RuntimeError):
    """A transfer with a neighbouring stage failed or timed out."""


@dataclass
class PendingSend:
    """A send still in flight, and what to do once its buffer may be reused."""

    work: dist.Work
    op: P2P
    on_done: Callable[[], None] | None = None


class P2PCommunicator:
    """Posts a schedule's transfer batches over the pipeline group of one rank."""

    def __init__(
        self, group: Group, timeout_s: float = 300.0, activity: Activity | None = None
    ) -> None:
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self._in_flight: list[PendingSend] = []
        # what this rank waits in, for the watchdog and for errors (shared by the executors
        # that use this communicator, which also record their computes in it)
        self.activity = activity or Activity()

    def _peer(self, op: P2P) -> int:
        return self.group.ranks[op.peer]

    def _wait(self, work: dist.Work, op: P2P) -> None:
        what = "receive from" if op.op == "recv" else "send to"
        self.activity.enter(
            op.op,
            "{} pipeline rank {} (global rank {}) of {}{}.{}",
            what,
            op.peer,
            self._peer(op),
            op.phase,
            op.microbatch,
            op.chunk,
        )
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            raise PipelineCommError(
                f"pipeline rank {self.group.rank}: {what} pipeline rank {op.peer} (global rank "
                f"{self._peer(op)}) of {op.phase}{op.microbatch}.{op.chunk} failed or timed out "
                f"after {self.timeout.total_seconds():.0f} s: {error}"
            ) from error

    def post(
        self, transfers: list[tuple[P2P, torch.Tensor, Callable[[], None] | None]]
    ) -> dict[P2P, dist.Work]:
        """Post one batch, in the schedule's order; return the receives, still in flight.

        transfers: (op, tensor, callback) with the callback run once a send's buffer is free.
        The caller waits for each receive (`wait`) just before the compute that needs it, so a
        forward can run while the gradient for the backward after it is still on its way.
        The sends of earlier batches are waited for after this one is posted.
        """
        earlier, self._in_flight = self._in_flight, []
        p2p_ops = [
            dist.P2POp(
                dist.isend if op.op == "send" else dist.irecv, tensor, self._peer(op), self.group.pg
            )
            for op, tensor, _ in transfers
        ]
        works = dist.batch_isend_irecv(p2p_ops)
        if len(works) != len(transfers):  # a coalescing backend (NCCL): one work for the batch
            works = works[-1:] * len(transfers)
        receives = {}
        for (op, _, on_done), work in zip(transfers, works):
            if op.op == "recv":
                receives[op] = work
            else:
                self._in_flight.append(PendingSend(work, op, on_done))
        self._complete(earlier)
        return receives

    def wait(self, op: P2P, work: dist.Work) -> None:
        """Wait for one posted receive; PipelineCommError naming the peer if it times out."""
        self._wait(work, op)

    def drain(self) -> None:
        """Wait for every send still in flight, then run its completion callback."""
        pending, self._in_flight = self._in_flight, []
        self._complete(pending)

    def _complete(self, pending: list[PendingSend]) -> None:
        for send in pending:
            self._wait(send.work, send.op)
            if send.on_done is not None:
                send.on_done()
