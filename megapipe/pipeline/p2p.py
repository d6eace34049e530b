"""Point-to-point transfers between pipeline stages: each `Comm` action posted per link.

Every transfer travels over the process group of its link (`schedules.p2p_link`: one group per
direction between two neighbouring stages), one `batch_isend_irecv` per link and batch. How a
posted transfer is waited for depends on the transport:

- **gloo** (CPU): each receive is waited on, with a timeout, just before the compute that needs
  it; sends are left in flight and waited on once the next batch is posted (posting first, so
  that a receive the peer's send waits for is never held back behind this rank's own wait).
- **NCCL** (GPU): waits are stream waits (`work.wait()` without a timeout makes the compute
  stream wait for the transfer; the host goes on), and sends are never waited for: NCCL keeps
  their tensors alive until they are done. No host stall per transfer; the process group's
  timeout and its watchdog bound a hang instead of a host-side timeout.
- **NCCL's ordering emulated on gloo** (`emulate_nccl_order`, `--emulate-nccl-p2p-order`, a
  debugging mode): NCCL runs a group's transfers on one stream in posting order, which gloo
  does not; here each link gets a worker thread that posts its batches one after the other,
  each once the one before it has completed, as the NCCL stream would. The host waits only
  for a compute's input and at the end of the step, as on the GPU. A schedule that would hang
  on NCCL hangs here too (and times out naming the peer), where plain gloo would pass
  (`parallel/emulated_stream.py`, shared with the context-parallel ring).

Shapes are known from the config, so there is no per-micro-batch shape handshake. A receive
that does not complete within the timeout raises an error naming the peer, instead of leaving
the rank waiting forever for a stage that died. A sent output may be let go of as soon as it is
posted: the transport holds its storage until the transfer is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megapipe.activity import Activity
from megapipe.errors import ConfigError, PipelineCommError
from megapipe.parallel.emulated_stream import EmulatedStream, StreamBatch
from megapipe.parallel.state import Group, ParallelState, PipelineLink
from megapipe.pipeline.schedules import P2P, p2p_link


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
    """Posts a schedule's transfer batches over the pipeline links of one rank."""

    def __init__(
        self,
        state: ParallelState,
        timeout_s: float = 300.0,
        activity: Activity | None = None,
        *,
        emulate_nccl_order: bool = False,
    ) -> None:
        self.group = state.pp
        self.links: Mapping[PipelineLink, Group] = state.pp_links
        self.timeout = timedelta(seconds=timeout_s)
        self.emulate_nccl_order = emulate_nccl_order
        self._streams: dict[Group, EmulatedStream] = {}  # one per process group, as NCCL's
        any_pg = next((g.pg for g in self.links.values()), None)
        self._host_waits = waits_block_host(any_pg)
        if emulate_nccl_order and not self._host_waits:
            raise ConfigError("--emulate-nccl-p2p-order emulates NCCL on gloo; this run is NCCL")
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
            if self._host_waits:
                posted.work.wait(self.timeout)
            else:  # NCCL: the compute stream waits; the host goes on
                posted.work.wait()
        except RuntimeError as error:
            raise PipelineCommError(
                f"pipeline rank {self.group.rank}: {what} pipeline rank {op.peer} (global rank "
                f"{self._peer(op)}) of {op.phase}{op.microbatch}.{op.chunk} failed or timed out "
                f"after {self.timeout.total_seconds():.0f} s: {error}"
            ) from error

    def post(self, transfers: list[tuple[P2P, torch.Tensor]]) -> dict[P2P, Posted]:
        """Post one batch, in the schedule's order, one call per process group (link); return
        the receives, still in flight, for `wait` just before the compute that needs each.

        On gloo the sends of earlier batches are waited for after this one is posted.
        """
        earlier, self._in_flight = self._in_flight, []
        by_group: dict[Group, list[tuple[P2P, torch.Tensor]]] = {}
        for op, tensor in transfers:
            group = self.links[p2p_link(self.group.rank, op)]
            by_group.setdefault(group, []).append((op, tensor))
        receives = {}
        for group, ops in by_group.items():
            p2p_ops = [
                dist.P2POp(
                    dist.isend if op.op == "send" else dist.irecv, tensor, self._peer(op), group.pg
                )
                for op, tensor in ops
            ]
            if self.emulate_nccl_order:
                stream = self._streams.get(group)
                if stream is None:
                    stream = self._streams[group] = EmulatedStream(self.timeout)
                works: list = [stream.submit(p2p_ops)] * len(ops)
            else:
                works = dist.batch_isend_irecv(p2p_ops)
                if len(works) != len(ops):  # a coalescing backend (NCCL): one work for the batch
                    works = works[-1:] * len(ops)
            for (op, _), work in zip(ops, works):
                posted = Posted(op, work)
                if op.op == "recv":
                    receives[op] = posted
                elif self._host_waits:
                    self._in_flight.append(posted)
        if self.emulate_nccl_order:  # the streams retire sends; keep those not yet done or failed
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
