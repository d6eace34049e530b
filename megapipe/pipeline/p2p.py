"""Point-to-point transfers between pipeline stages: each `Comm` action is one group call.

Every transfer travels over the pipeline's process group, and each batch of a schedule is one
`batch_isend_irecv` (one NCCL group call, whose sends and receives progress together), as in
Megatron-LM; the schedule fixes which batches may hold receives posted early
(`schedules.build_schedule`). Before the first step, `connect` makes every connection the
schedule uses, pair by pair in one global order (`schedules.connect_schedule`), after a
collective over the group that creates its NCCL communicator with every member present (torch
documents that the first batch_isend_irecv of a group must involve all of its ranks). How a
posted transfer is waited for depends on the transport:

- **gloo** (CPU): each receive is waited on, with a timeout, just before the compute that needs
  it; sends are left in flight and waited on once the next batch is posted (posting first, so
  that a receive the peer's send waits for is never held back behind this rank's own wait).
- **NCCL** (GPU): waits are stream waits (`work.wait()` without a timeout makes the compute
  stream wait for the transfer; the host goes on), and sends are never waited for: NCCL keeps
  their tensors alive until they are done. No host stall per transfer; the process group's
  timeout and its watchdog bound a hang instead of a host-side timeout.
- **NCCL's rules emulated on gloo** (`emulation`, `--emulate-nccl-p2p-order`, a debugging mode):
  batches go through `parallel/emulated_stream.NcclEmulation` (a group's calls in posting order,
  lazy connections, one queue per rank); the host waits only for a compute's input and at the
  end of the step, as on the GPU. A schedule that would hang on NCCL hangs here too (and times
  out naming the peer), where plain gloo would pass.

Shapes are known from the config, so there is no per-micro-batch shape handshake. A receive
that does not complete within the timeout raises an error naming the peer, instead of leaving
the rank waiting forever for a stage that died. A sent output may be let go of as soon as it is
posted: the transport holds its storage until the transfer is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megapipe.activity import Activity
from megapipe.errors import ConfigError, PipelineCommError
from megapipe.parallel.emulated_stream import (
    NcclEmulation,
    StreamBatch,
    emulation_rules,
    process_emulation,
)
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.schedules import P2P, connect_schedule


@dataclass
class Posted:
    """One transfer handed to the transport; waited for at most once (a second wait on a gloo
    work that already finished would time out)."""

    op: P2P
    work: dist.Work | StreamBatch
    waited: bool = False


def _succeeded(work: dist.Work | StreamBatch) -> bool:
    return isinstance(work, StreamBatch) and work.succeeded


def waits_block_host(pg: dist.ProcessGroup | None) -> bool:
    """Whether waiting for a transfer of `pg` must block the host (gloo) or can be a stream wait
    that bounds no time itself (NCCL: the process group's timeout and watchdog do)."""
    return pg is None or dist.get_backend(pg) != "nccl"


class P2PCommunicator:
    """Posts a schedule's transfer batches over the pipeline group of one rank.

    emulate_nccl_order: NCCL's rules to emulate on gloo (True: all of them, see
    `emulated_stream.emulation_rules`); nothing by default.
    """

    def __init__(
        self,
        state: ParallelState,
        timeout_s: float = 300.0,
        activity: Activity | None = None,
        *,
        emulate_nccl_order: bool | Iterable[str] = False,
    ) -> None:
        self.group = state.pp
        self.device = state.device
        self.timeout = timedelta(seconds=timeout_s)
        self._host_waits = waits_block_host(self.group.pg)
        rules = emulation_rules(emulate_nccl_order)
        if rules and not self._host_waits:
            raise ConfigError("--emulate-nccl-p2p-order emulates NCCL on gloo; this run is NCCL")
        self.emulation: NcclEmulation | None = (
            process_emulation(rules, self.timeout) if rules else None
        )
        self._connected_chunks = 0  # the virtual stages `connect` has made connections for
        self._in_flight: list[Posted] = []  # sends, waited for later (gloo only)
        # what this rank waits in, for the watchdog and for errors (shared by the executors
        # that use this communicator, which also record their computes in it)
        self.activity = activity or Activity()

    def _peer(self, op: P2P) -> int:
        return self.group.ranks[op.peer]

    def _wait(self, posted: Posted) -> None:
        if posted.waited:
            return
        posted.waited = True
        op = posted.op
        what = "receive from" if op.op == "recv" else "send to"
        item = f"{op.phase}{op.microbatch}.{op.chunk}"
        if op.microbatch < 0:  # `connect`'s
            item = "the start-up connection token"
        self.activity.enter(
            op.op, "{} pipeline rank {} (global rank {}) of {}", what, op.peer, self._peer(op), item
        )
        try:
            if self._host_waits:
                posted.work.wait(self.timeout)
            else:  # NCCL: the compute stream waits; the host goes on
                posted.work.wait()
        except RuntimeError as error:
            raise PipelineCommError(
                f"pipeline rank {self.group.rank}: {what} pipeline rank {op.peer} (global rank "
                f"{self._peer(op)}) of {item} failed or timed out after "
                f"{self.timeout.total_seconds():.0f} s: {error}"
            ) from error

    def connect(self, num_chunks: int) -> None:
        """Make every connection a schedule over `num_chunks` model chunks per rank uses,
        before its first transfer: one exchange of a one-element token per pair of neighbours,
        pair by pair in one global order (`schedules.connect_schedule`), so that no step's
        transfer waits in NCCL's lazy connection handshake whatever its posting. On NCCL an
        all-reduce over the pipeline group comes first: torch documents that the first
        batch_isend_irecv of a group must involve all of its ranks, as creating the group's
        communicator does (gloo has no such rule, and a collective could not name a silent
        peer as the tokens' receives do). Collective over the pipeline group; once per chunk
        count."""
        if self.group.size == 1 or num_chunks <= self._connected_chunks:
            return
        if self._connected_chunks == 0 and not self._host_waits:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group.pg)
        for action in connect_schedule(self.group.size, num_chunks, self.group.rank):
            transfers = [(op, torch.zeros(1, device=self.device)) for op in action.ops]
            for posted in self.post(transfers).values():
                self.wait(posted)
        self.drain()
        self._connected_chunks = num_chunks

    def collectives_behind_queue(self) -> contextlib.AbstractContextManager:
        """A context in which collectives wait behind this rank's queued transfers when the
        emulation has one queue per rank (a no-op otherwise)."""
        if self.emulation is None:
            return contextlib.nullcontext()
        return self.emulation.collectives_behind_queue()

    def post(self, transfers: list[tuple[P2P, torch.Tensor]]) -> dict[P2P, Posted]:
        """Post one batch as one group call on the pipeline group, in the schedule's order;
        return the receives, still in flight, for `wait` just before the compute that needs
        each. On gloo the sends of earlier batches are waited for after this one is posted."""
        earlier, self._in_flight = self._in_flight, []
        p2p_ops = [
            dist.P2POp(
                dist.isend if op.op == "send" else dist.irecv, tensor, self._peer(op), self.group.pg
            )
            for op, tensor in transfers
        ]
        ops = [op for op, _ in transfers]
        if self.emulation is not None:
            communicator = f"pipeline:{self.group.pg.group_name}"
            peers = {self._peer(op) for op in ops}
            works: list = [self.emulation.submit(communicator, peers, p2p_ops)] * len(ops)
        else:
            works = dist.batch_isend_irecv(p2p_ops)
            if len(works) != len(ops):  # a coalescing backend (NCCL): one work for the batch
                works = works[-1:] * len(ops)
        receives = {}
        for op, work in zip(ops, works):
            posted = Posted(op, work)
            if op.op == "recv":
                receives[op] = posted
            elif self._host_waits:
                self._in_flight.append(posted)
        if self.emulation is not None:  # the stream retires sends; keep those not yet done
            self._in_flight[:0] = [s for s in earlier if not _succeeded(s.work)]
        else:
            for send in earlier:
                self._wait(send)
        return receives

    def wait(self, posted: Posted) -> None:
        """Wait for one posted receive (once); PipelineCommError naming the peer on a timeout."""
        self._wait(posted)

    def drain(self) -> None:
        """Wait for every send still in flight (gloo; the emulation's streams run dry too)."""
        pending, self._in_flight = self._in_flight, []
        for send in pending:
            self._wait(send)
