"""Ring attention: the "p2p" context-parallel attention (and the gathered-K/V variant that
"all_gather" runs), over the block math of `context_parallel_blocks.py`.

Each CP rank holds its queries and one K/V block; the K/V blocks travel round the CP ring
(send to the next rank, receive from the previous one), so after CP steps every rank has seen
every block. Each step's partial result is merged with the online-softmax rule (running
log-sum-exp per row, fp32), so nothing [s, S] is ever materialised (except, with attention
dropout, the keep-mask of this rank's query rows, [b, heads, s, S] bool, saved for backward;
each block applies its slice to the numerator only, flash attention's rule).

Backward is the mirror: K/V travel the ring again, each block's probabilities are recomputed
from the saved final log-sum-exp, and each block's dK/dV accumulator travels with it, so after
CP steps (one more hop than K/V) it is back home holding every rank's contribution.

Within a step the local queries and the visiting block are each cut in two (the two chunks of
the load-balanced layout), and each of the four pairs is classified from the tokens' global
positions (and document ids): fully visible (no mask), partly visible (a boolean mask), or
invisible (skipped). With Megatron's layout half the off-diagonal pairs are skipped, so every
rank does the same causal work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megapipe.errors import ContextParallelCommError
from megapipe.model.context_parallel_blocks import (
    HIDDEN,
    block_backward,
    block_forward,
    fused_block_backward,
    fused_block_forward,
    halves,
    merge_into,
    pair_mask,
)
from megapipe.parallel.emulated_stream import StreamBatch, process_emulation


@dataclass(frozen=True)
class CPGroup:
    """The CP process group as this rank sees it: torch group (None for one rank), our index,
    the group's size and its members' global ranks (what isend/irecv address).

    emulate_nccl_order (--emulate-nccl-p2p-order, gloo only): the NCCL rules under which the
    ring's transfers run (`emulated_stream.NcclEmulation`; empty: none); timeout: how long a
    ring transfer may take (None: the process group's own timeout,
    --distributed-timeout-minutes)."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    global_ranks: tuple[int, ...]
    emulate_nccl_order: frozenset[str] = frozenset()
    timeout: timedelta | None = None

    @property
    def next(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.size]


# --------------------------------------------------------------------------------------------
# Masks and blockwise attention (plain tensors, no autograd).
# --------------------------------------------------------------------------------------------


def _group_timeout(pg: dist.ProcessGroup | None) -> timedelta | None:
    """The process group's own timeout (None when torch's internals do not say)."""
    if pg is None:
        return None
    try:
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


class _Ring:
    """The ring transfers of one forward or backward pass.

    Each transfer (a step's K/V, or a dK/dV accumulator) is posted as one batch
    (`batch_isend_irecv`; on NCCL one group call): NCCL runs the point-to-point operations
    between two ranks on one stream in posting order, so with CP=2 (next == previous rank) a
    send posted on its own before the receive waits for the peer's receive, queued behind the
    peer's own send: a deadlock on GPUs, which gloo forgives. With `cp.emulate_nccl_order` the
    batches go through this process's `NcclEmulation` (`parallel/emulated_stream.py`, shared
    with the pipeline: one queue per rank), keyed as torch's NCCL backend picks communicators:
    a batch uses the group's communicator, an operation posted on its own the communicator of
    its two ranks. Every transfer is waited for before the pass returns.
    """

    # Tests only: post each send and receive on its own (the posting before the batches),
    # the order NCCL deadlocks on at CP=2 (tests/test_context_parallel_nccl_order.py).
    grouped = True

    def __init__(self, cp: CPGroup, phase: str) -> None:
        self.cp, self.phase = cp, phase
        self.host_waits = cp.pg is None or dist.get_backend(cp.pg) != "nccl"
        self.timeout = cp.timeout or _group_timeout(cp.pg) or timedelta(minutes=30)
        self.emulation = (
            process_emulation(cp.emulate_nccl_order, self.timeout)
            if cp.emulate_nccl_order
            else None
        )
        # the emulation's name of the CP group's communicator (every member's the same)
        self.communicator = f"cp:{cp.pg.group_name}" if self.emulation is not None else ""

    def post(self, tensors: list[torch.Tensor], step: int, what: str, tag: int) -> _Transfer:
        """Send `tensors` (`what`, e.g. "K/V") to the next rank, receive as many from the
        previous one; in flight until the transfer's `wait`."""
        return _Transfer(self, tensors, step, what, tag)

    def submit(self, ops: list[dist.P2POp]) -> list[tuple[dist.P2POp, dist.Work | StreamBatch]]:
        """Post `ops`; (operation, what to wait for) pairs, one per handle the transport gave
        (a batch's handle is paired with its first receive, which its error then names)."""
        receive = next(op for op in ops if op.op is dist.irecv)
        emulation = self.emulation
        if not self.grouped:
            if emulation is not None:  # torch's NCCL: a communicator per pair for lone p2p
                me, name = self.cp.global_ranks[self.cp.rank], self.communicator
                return [
                    (op, emulation.submit(f"{name}:{min(me, op.peer)}-{max(me, op.peer)}",
                                          [op.peer], [op]))
                    for op in ops
                ]  # fmt: skip
            return [(op, op.op(op.tensor, op.peer, op.group, op.tag)) for op in ops]
        if emulation is not None:
            return [(receive, emulation.submit(self.communicator, {op.peer for op in ops}, ops))]
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            return list(zip(ops, works))
        return [(receive, work) for work in works]  # a coalescing backend (NCCL)

    def failure(
        self, transfer: _Transfer, op: dist.P2POp, error: BaseException, whole_batch: bool
    ) -> str:
        """The message of a transfer that did not complete: the pass, step, operation and peer
        (`whole_batch`: the operation stands for its batch, sends included)."""
        cp = self.cp
        if op.op is dist.irecv:
            action = f"receive of {transfer.what} from {self._peer(cp.rank - 1)}"
        else:
            action = f"send of {transfer.what} to {self._peer(cp.rank + 1)}"
        if whole_batch and cp.next != cp.prev:
            action += f" (and its send to {self._peer(cp.rank + 1)})"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        limit, waited = self.timeout.total_seconds(), time.monotonic() - transfer.posted_at
        how = f"timed out after {limit:g} s" if waited >= 0.95 * limit else "failed"
        return (
            f"context-parallel ring (p2p) {self.phase} step {transfer.step}: {action} {how} "
            f"(this is CP rank {cp.rank} of {cp.size}, global rank "
            f"{cp.global_ranks[cp.rank]}): {first}"
        )

    def _peer(self, index: int) -> str:
        index %= self.cp.size
        return f"CP rank {index} (global rank {self.cp.global_ranks[index]})"


class _Transfer:
    """Tensors sent to the next rank, and as many received from the previous one, posted as
    one batch; in flight until `wait`, which raises ContextParallelCommError naming the peer."""

    def __init__(
        self, ring: _Ring, tensors: list[torch.Tensor], step: int, what: str, tag: int
    ) -> None:
        cp = ring.cp
        self.ring, self.step, self.what = ring, step, what
        self.posted_at = time.monotonic()
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = []
        for i, (out, into) in enumerate(zip(self.sent, self.received)):
            ops.append(dist.P2POp(dist.isend, out, cp.next, cp.pg, tag + i))
            ops.append(dist.P2POp(dist.irecv, into, cp.prev, cp.pg, tag + i))
        try:  # gloo may fail at once (a peer already gone)
            self.posted = ring.submit(ops)
        except RuntimeError as error:
            raise ContextParallelCommError(ring.failure(self, ops[1], error, True)) from error
        self.done = False

    def wait(self) -> list[torch.Tensor]:
        if not self.done:
            ring = self.ring
            for op, work in self.posted:
                try:
                    if ring.host_waits:
                        work.wait(ring.timeout)
                    else:  # NCCL: the compute stream waits; the watchdog bounds a hang
                        work.wait()
                except RuntimeError as error:
                    whole = len(self.posted) < 2 * len(self.sent)  # one handle per batch
                    raise ContextParallelCommError(ring.failure(self, op, error, whole)) from error
            self.done = True
        return self.received


@dataclass
class Layout:
    """Global positions ([S_local] per rank) and document ids ([b, S_local] per rank, or None)
    of every CP rank's tokens: what decides each pair of sub-blocks' mask."""

    positions: list[torch.Tensor]
    documents: list[torch.Tensor] | None

    def pairs(self, q_rank: int, k_rank: int, n: int) -> list[tuple[slice, slice, object]]:
        """The (query slice, key slice, mask) of each visible pair for one step."""
        out = []
        docs = self.documents
        for qs in halves(n):
            for ks in halves(n):
                mask = pair_mask(
                    self.positions[q_rank][qs],
                    self.positions[k_rank][ks],
                    None if docs is None else docs[q_rank][:, qs],
                    None if docs is None else docs[k_rank][:, ks],
                )
                if mask is not HIDDEN:
                    out.append((qs, ks, mask))
        return out


def _output_buffers(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 (or wider) output accumulator, laid out as [s, b, heads, d] in memory as SDPA's
    output is for q of that layout (so the projection's [s, b, heads * d] input is a view of
    it, not a copy), and the running log-sum-exp, -inf until a block is merged."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, heads, s, d = q.shape
    out = torch.zeros((s, b, heads, d), dtype=acc, device=q.device).permute(1, 2, 0, 3)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)


def _forward_block(
    q, kv: list[torch.Tensor], src: int, rank: int, layout: Layout, scale: float, fused: bool,
    keep, dropout_p: float, out: torch.Tensor, lse: torch.Tensor,
) -> None:  # fmt: skip
    """Merge into `out` and `lse` this rank's queries' attention over the K/V block that CP
    rank `src` holds (`kv`: its keys and values)."""
    n = q.shape[2]
    for qs, ks, mask in layout.pairs(rank, src, n):
        blocks = q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, mask
        if keep is not None:
            part, part_lse = block_forward(*blocks, _block_keep(keep, src, n, qs, ks), dropout_p)
        else:
            part, part_lse = (fused_block_forward if fused else block_forward)(*blocks)
        merge_into(out[:, :, qs], lse[:, :, qs], part, part_lse)


def _backward_block(ctx, q, kv: list[torch.Tensor], src: int, dout, out, lse, delta, dq):
    """Add into dq this block's share of the queries' gradient; return the block's (dK, dV)
    from this rank's queries. `ctx`: the forward's layout, scale, fused, keep, dropout_p."""
    n, acc = q.shape[2], lse.dtype
    dk = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
    dv = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
    for qs, ks, mask in ctx.layout.pairs(ctx.cp.rank, src, n):
        blocks = q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], dout[:, :, qs]
        if ctx.fused:
            bq, bk, bv = fused_block_backward(
                *blocks, out[:, :, qs], lse[:, :, qs], ctx.scale, mask
            )
        else:
            bq, bk, bv = block_backward(
                *blocks, lse[:, :, qs], delta[:, :, qs], ctx.scale, mask,
                _block_keep(ctx.keep, src, n, qs, ks), ctx.dropout_p,
            )  # fmt: skip
        dq[:, :, qs] += bq
        dk[:, :, ks] += bk
        dv[:, :, ks] += bv
    return dk, dv


def _backward_start(ctx, dout):
    """What every backward begins with: the saved tensors, a contiguous dout, the reference
    math's rowsum(dO * O) and the fp32 dq accumulator."""
    q, k, v, out, lse, keep = ctx.saved_tensors
    ctx.keep = keep
    dout = dout.contiguous()
    delta = None if ctx.fused else (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    return q, k, v, out, lse, dout, delta, dq


class RingAttention(torch.autograd.Function):
    """p2p context-parallel attention; see the module docstring. `overlap=False` waits for each
    transfer before computing (the benchmark's baseline); `fused`: the blocks run through the
    CPU flash kernels (`fused_blocks_available`), else through the reference math. `keep`
    ([b, h, s_local, S] bool, or None): attention dropout's keep-mask of this rank's query rows,
    its key columns in rank order (rank 0's tokens, then rank 1's, ...), so the block from rank
    `src` is the column slice [src * s_local, (src + 1) * s_local); with it the blocks run the
    reference math (the flash kernels take no mask) with `dropout_p`."""

    @staticmethod
    def forward(
        ctx, q, k, v, cp: CPGroup, layout: Layout, scale: float, overlap: bool, fused,
        keep=None, dropout_p: float = 0.0,
    ):  # fmt: skip
        fused = fused and keep is None
        out, lse = _output_buffers(q)
        kv, src = [k, v], cp.rank
        ring = _Ring(cp, "forward")
        for step in range(cp.size):
            pending = None
            if step < cp.size - 1:
                pending = ring.post(kv, step, "K/V", tag=0)
                if not overlap:
                    pending.wait()
            _forward_block(q, kv, src, cp.rank, layout, scale, fused, keep, dropout_p, out, lse)
            if pending is not None:
                kv, src = pending.wait(), (src - 1) % cp.size
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.cp, ctx.layout, ctx.scale, ctx.overlap, ctx.fused = cp, layout, scale, overlap, fused
        ctx.dropout_p = dropout_p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, dout, delta, dq = _backward_start(ctx, dout)
        cp = ctx.cp
        kv, src, grads, home = [k, v], cp.rank, None, None
        ring = _Ring(cp, "backward")
        for step in range(cp.size):
            pending = None
            if step < cp.size - 1:
                pending = ring.post(kv, step, "K/V", tag=0)
                if not ctx.overlap:
                    pending.wait()
            dk, dv = _backward_block(ctx, q, kv, src, dout, out, lse, delta, dq)
            if grads is not None:  # the visiting block's accumulator, from the previous rank
                held_dk, held_dv = grads.wait()
                dk += held_dk
                dv += held_dv
            if cp.size == 1:
                home = dk, dv
            else:  # the accumulator travels with its block: on to the next rank (last hop: home)
                grads = ring.post([dk, dv], step, "dK/dV", tag=2)
                if not ctx.overlap:
                    grads.wait()
            if pending is not None:
                kv, src = pending.wait(), (src - 1) % cp.size
        dk, dv = home if grads is None else grads.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 7)


class GatheredBlocksAttention(torch.autograd.Function):
    """The "all_gather" attention's core: this rank's queries over every rank's K/V, already
    gathered in rank order (k, v: [b, groups, CP * s_local, d], rank r's tokens at
    [r * s_local, (r + 1) * s_local)), one block per rank through the ring's block math, with
    no transfers; nothing [s, S] is built (the masks are per pair of sub-blocks, and causal
    pairs skip or run unmasked as in the ring). Backward returns dK and dV for the gathered
    tensors (the gather's adjoint reduce-scatters them). `keep`: as RingAttention's."""

    @staticmethod
    def forward(
        ctx, q, k, v, cp: CPGroup, layout: Layout, scale: float, fused, keep=None,
        dropout_p: float = 0.0,
    ):  # fmt: skip
        fused = fused and keep is None
        out, lse = _output_buffers(q)
        n = q.shape[2]
        for src in range(cp.size):
            kv = [k[:, :, src * n : (src + 1) * n], v[:, :, src * n : (src + 1) * n]]
            _forward_block(q, kv, src, cp.rank, layout, scale, fused, keep, dropout_p, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.cp, ctx.layout, ctx.scale, ctx.fused, ctx.dropout_p = (
            cp,
            layout,
            scale,
            fused,
            dropout_p,
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, dout, delta, dq = _backward_start(ctx, dout)
        n = q.shape[2]
        dk_all = torch.empty(k.shape, dtype=lse.dtype, device=k.device)
        dv_all = torch.empty(v.shape, dtype=lse.dtype, device=v.device)
        for src in range(ctx.cp.size):
            piece = slice(src * n, (src + 1) * n)
            kv = [k[:, :, piece], v[:, :, piece]]
            dk_all[:, :, piece], dv_all[:, :, piece] = _backward_block(
                ctx, q, kv, src, dout, out, lse, delta, dq
            )
        return dq.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype), *([None] * 6)


def _block_keep(keep: torch.Tensor | None, src: int, n: int, qs: slice, ks: slice):
    """The dropout keep-mask of one pair of sub-blocks: rows `qs` of this rank's queries,
    columns `ks` of the block rank `src` holds (`RingAttention`'s `keep`), or None."""
    if keep is None:
        return None
    return keep[:, :, qs, src * n + ks.start : src * n + ks.stop]
