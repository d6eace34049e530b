"""Context parallelism (CP): attention over a sequence split across the ranks of a CP group.

Layout (Megatron's load-balanced causal split): a sequence of S tokens is cut into 2*CP chunks
of S/(2*CP); CP rank r holds chunks r and 2*CP-1-r, concatenated in that order. Under a causal
mask an early chunk is cheap and a late one dear, so pairing them gives every rank the same
work. `chunk_positions` gives the global positions a rank holds, `split_sequence` cuts a full
tensor into a rank's share and `gather_from_cp` puts the shares back in global order.

`context_parallel_attention` is, for every rank's rows, exactly causal attention over the whole
sequence (values and gradients), the mask taken from the tokens' global positions (and, for
packed documents, their document ids: Megatron's --reset-attention-mask). Three ways to get
the keys and values a rank's queries need (`comm_type`, Megatron's --cp-comm-type):

- "p2p": ring attention (`context_parallel_ring.py`): K/V blocks travel the CP ring, each
  step's transfer overlapping the previous block's attention; nothing [s, S] is materialised;
  each block runs through torch's CPU flash-attention kernels where available, else (and as
  the tested reference) through plain matmuls and an fp32 softmax;
- "all_gather": K/V gathered from every rank once (backward: dK/dV reduce-scattered), then the
  local queries attend to each rank's block through the ring's block math, without transfers
  (`GatheredBlocksAttention`; invisible pairs skipped, nothing [s, S] built);
- "a2a" (DeepSpeed Ulysses): an all-to-all turns the sequence split into a head split
  ([b, heads/CP, S, d], chunks put back in global order), plain causal attention runs on whole
  sequences, and a second all-to-all turns it back; needs heads and query groups divisible by CP.

`model/attention.py` runs it when the CP group has more than one rank.

Attention dropout (`dropout_p`, `dropout_mask`): every rank applies, to each (query, key) pair
it computes, the entry of one logical keep-mask [b, heads, S, S] indexed by the tokens' global
positions, so CP trains exactly as one rank does with the same mask (`model/dropout.py`'s
layout-invariant masks). p2p and all_gather apply it inside each block with flash attention's
rule (the log-sum-exp is the undropped softmax's; only the numerator P * keep / (1 - p) is
dropped, and the backward takes delta = rowsum(dO * O) of the dropped output), through the
reference block math (the CPU flash kernels take no external mask); a2a runs an unfused fp32
softmax -> mask -> matmul, the one-rank `explicit_attention`'s order of operations. Each rank
keeps only its share of the mask for backward: its query rows ([b, heads, s_local, S] bool)
for p2p and all_gather, its heads ([b, heads/CP, S, S]) for a2a.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.data.context_parallel_split import chunk_positions
from megapipe.model.context_parallel_blocks import fused_blocks_available, pair_mask
from megapipe.model.context_parallel_ring import (
    CPGroup,
    GatheredBlocksAttention,
    Layout,
    RingAttention,
)
from megapipe.parallel.emulated_stream import emulation_rules
from megapipe.parallel.mappings import all_gather_single, reduce_scatter_single

COMM_TYPES = ("p2p", "all_gather", "a2a")

__all__ = [
    "COMM_TYPES",
    "context_parallel_attention",
    "cp_group",
    "gather_from_cp",
]


# --------------------------------------------------------------------------------------------
# Layout.
# --------------------------------------------------------------------------------------------


def gather_from_cp(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's share (sequence along `dim`) put back into the full sequence in global
    order, on every rank (an all-gather over the CP group). Plain tensors: no autograd."""
    cp = cp_group(group)
    if cp.size == 1:
        return x
    pieces = _all_gather_dim0(x.movedim(dim, 0), cp)
    seq_len = pieces.shape[0]
    order = torch.cat([chunk_positions(seq_len, cp.size, r) for r in range(cp.size)])
    full = torch.empty_like(pieces).index_copy_(0, order.to(x.device), pieces)
    return full.movedim(0, dim)


def cp_group(group) -> CPGroup:
    """Normalise the CP group: megapipe's `Group`, a torch `ProcessGroup`, or None (one rank)."""
    if group is None:
        return CPGroup(None, 0, 1, (dist.get_rank() if dist.is_initialized() else 0,))
    if isinstance(group, CPGroup):
        return group
    if hasattr(group, "ranks") and hasattr(group, "pg"):  # megapipe.parallel.state.Group
        return CPGroup(group.pg, group.rank, group.size, tuple(group.ranks))
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    return CPGroup(group, dist.get_rank(group), size, ranks)


def _all_gather_dim0(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * cp.size, *x.shape[1:]))
    all_gather_single(out, x, group=cp.pg)
    return out


def _layout(
    cp: CPGroup, s_local: int, positions: torch.Tensor | None, documents: torch.Tensor | None
) -> Layout:
    """Every rank's positions and document ids (gathered; the default positions are computed),
    on the CPU: the masks are decided there (which blocks to skip) and then moved."""
    if positions is None:
        if cp.size > 1 and s_local % 2:
            raise ValueError(
                f"local sequence length {s_local} is odd: the load-balanced layout holds two "
                "equal chunks per context-parallel rank"
            )
        pos = [chunk_positions(s_local * cp.size, cp.size, r) for r in range(cp.size)]
    elif cp.size == 1:
        pos = [positions.long().cpu()]
    else:
        pos = list(_all_gather_dim0(positions.long(), cp).cpu().chunk(cp.size))
    docs = None
    if documents is not None:
        if cp.size == 1:
            docs = [documents.long().cpu()]
        else:
            gathered = _all_gather_dim0(documents.long().t(), cp).t().cpu()
            docs = list(gathered.chunk(cp.size, dim=1))
    return Layout(pos, docs)


# --------------------------------------------------------------------------------------------
# all_gather and a2a: collectives with their adjoints.
# --------------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """[b, g, s, d] -> [b, g, CP*s, d], the ranks' blocks in rank order; backward: the
    gradient summed over the group and this rank's block kept (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, cp: CPGroup):
        ctx.cp = cp
        return _all_gather_dim0(x.movedim(2, 0), cp).movedim(0, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        grad = grad.movedim(2, 0).contiguous()
        out = grad.new_empty((grad.shape[0] // cp.size, *grad.shape[1:]))
        reduce_scatter_single(out, grad, group=cp.pg)
        return out.movedim(0, 2).contiguous(), None


def _all_to_all(x: torch.Tensor, cp: CPGroup, to_heads: bool) -> torch.Tensor:
    """to_heads: [b, h, s, d] (sequence split) -> [b, h/CP, CP*s, d] (head split, the ranks'
    blocks in rank order); otherwise the inverse."""
    p = cp.size
    if to_heads:
        b, h, s, d = x.shape
        send = x.reshape(b, p, h // p, s, d).transpose(0, 1).contiguous()
    else:
        b, hp, seq, d = x.shape
        send = x.reshape(b, hp, p, seq // p, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # [source rank, b, ...]
    dist.all_to_all_single(received, send, group=cp.pg)
    if to_heads:
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)
    return received.transpose(0, 1).reshape(b, p * hp, seq // p, d)


class _AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all; its adjoint is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, cp: CPGroup, to_heads: bool):
        ctx.cp, ctx.to_heads = cp, to_heads
        return _all_to_all(x, cp, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.cp, not ctx.to_heads), None, None


def _sdpa(q, k, v, scale: float, mask) -> torch.Tensor:
    """SDPA with GQA; `mask` from `pair_mask` ([B, 1, 1, sq, sk] -> [B, 1, sq, sk])."""
    attn_mask = None if mask is None else mask[:, :, 0].to(q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _unfused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    keep: torch.Tensor,
    dropout_p: float,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) in fp32, cast to q's dtype, times keep / (1 - dropout_p),
    @ v: `model.attention.explicit_attention`'s order of operations with layout-invariant
    dropout. mask: [B, 1, sq, sk] or [sq, sk] bool (True = may attend) or None; keep: [b,
    heads, sq, sk] bool."""
    heads, groups = q.shape[1], k.shape[1]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = probs * keep.to(probs.dtype).mul_(1.0 / (1.0 - dropout_p))
    return torch.matmul(probs, v)


def _all_gather_attention(
    q, k, v, cp: CPGroup, layout: Layout, scale: float, fused: bool, keep=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """K and V gathered from every rank once (backward: their gradients reduce-scattered), then
    this rank's queries attend over them block by block (`GatheredBlocksAttention`: the ring's
    block math, no [s, S] mask). keep: as for p2p, this rank's query rows with the key columns
    in rank order (or None: no dropout)."""
    if cp.size > 1:
        k, v = _GatherSequence.apply(k, cp), _GatherSequence.apply(v, cp)
    return GatheredBlocksAttention.apply(q, k, v, cp, layout, scale, fused, keep, dropout_p)


def _a2a_attention(
    q, k, v, cp: CPGroup, layout: Layout, scale: float, keep=None, dropout_p: float = 0.0
) -> torch.Tensor:
    """keep: the dropout mask of this rank's heads after the all-to-all [b, heads/CP, S, S],
    rows and columns in global order (or None: no dropout)."""
    heads, groups = q.shape[1], k.shape[1]
    if heads % cp.size or groups % cp.size:
        raise ValueError(
            f"a2a context parallelism needs the attention heads ({heads}) and query groups "
            f"({groups}) divisible by the context-parallel size ({cp.size})"
        )
    if cp.size > 1:
        q, k, v = (_AllToAll.apply(x, cp, True) for x in (q, k, v))
    pos = torch.cat(layout.positions)
    order = torch.argsort(pos)
    index = order.to(q.device)
    q, k, v = q[:, :, index], k[:, :, index], v[:, :, index]  # global order
    pos = pos[order]
    seq_len = len(pos)
    if keep is not None:
        docs = None if layout.documents is None else torch.cat(layout.documents, 1)[:, order]
        mask = pair_mask(pos, pos, docs, docs)
        mask = None if mask is None else mask[:, :, 0]  # [B, 1, S, S]
        out = _unfused(q, k, v, scale, mask, keep, dropout_p)
    elif layout.documents is None and torch.equal(pos, torch.arange(seq_len)):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    else:
        docs = None if layout.documents is None else torch.cat(layout.documents, 1)[:, order]
        out = _sdpa(q, k, v, scale, pair_mask(pos, pos, docs, docs))
    out = out[:, :, torch.argsort(index)]  # back to rank order
    return _AllToAll.apply(out, cp, False) if cp.size > 1 else out


# --------------------------------------------------------------------------------------------
# The entry point.
# --------------------------------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    comm_type: str,
    scale: float,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    overlap: bool = True,
    block_kernel: str = "auto",
    emulate_nccl_order: bool | Iterable[str] = False,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (CP-split) sequence.

    q: [b, heads, s_local, d]; k, v: [b, groups, s_local, d] (GQA: head i uses group
    i // (heads / groups)); s_local = S / CP tokens of this rank. `positions` ([s_local]) are
    the tokens' global positions, by default `chunk_positions(S, CP, rank)`; `document_ids`
    ([b, s_local]) restrict attention to tokens of the same document. `group`: the CP group
    (megapipe `Group`, torch `ProcessGroup` or None). `overlap` (p2p only): post each ring
    transfer before computing with the block in hand (False: wait for it first).
    `block_kernel` (p2p only): "fused" runs each block through torch's CPU flash-attention
    kernels, "reference" through plain matmuls and softmax, "auto" fused where available
    (with dropout: reference).
    `dropout_p` > 0: attention dropout with `dropout_mask`, the whole sequence's keep-mask
    [b, heads, S, S] (bool, True = kept) of this rank's heads, indexed [query position, key
    position] by global positions, the same on every CP rank (`LogicalDropout.
    attention_keep_mask` of the whole sequence); each rank uses its pairs' entries. Without a
    mask one is drawn here from the device's default generator (each rank its own: valid
    dropout, but not the one-rank run's).
    `emulate_nccl_order` (p2p on gloo, --emulate-nccl-p2p-order): the ring's transfers run
    under NCCL's rules (True: all of them; or their names, `emulated_stream.emulation_rules`),
    so a posting order that would hang on GPUs times out here too; `timeout_s`
    (p2p): how long a ring transfer may take before ContextParallelCommError names the peer
    (None: the process group's timeout).
    Returns [b, heads, s_local, d], differentiable w.r.t. q, k and v."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown context-parallel comm_type {comm_type!r}; one of {COMM_TYPES}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"expected q [b, heads, s, d] and k, v [b, groups, s, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention heads ({q.shape[1]}) are not divisible by query groups ({k.shape[1]})"
        )
    if block_kernel not in ("auto", "fused", "reference"):
        raise ValueError(f"unknown block_kernel {block_kernel!r}; auto, fused or reference")
    if block_kernel == "fused" and dropout_p > 0:
        raise ValueError(
            "block_kernel 'fused' with attention dropout: the CPU flash kernels take no "
            "external dropout mask; use 'reference' or 'auto'"
        )
    fused = block_kernel != "reference" and fused_blocks_available(q) and dropout_p == 0
    if block_kernel == "fused" and not fused:
        raise ValueError(f"no fused attention blocks for {q.dtype} on {q.device.type}")
    cp = cp_group(group)
    if emulate_nccl_order or timeout_s is not None:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        rules = emulation_rules(emulate_nccl_order)
        cp = replace(cp, emulate_nccl_order=rules, timeout=timeout)
    layout = _layout(cp, q.shape[2], positions, document_ids)
    keep = None
    if dropout_p > 0:
        keep = _local_keep(q, cp, layout, comm_type, dropout_p, dropout_mask)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, cp, layout, scale, overlap, fused, keep, dropout_p)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, cp, layout, scale, fused, keep, dropout_p)
    return _a2a_attention(q, k, v, cp, layout, scale, keep, dropout_p)


def _local_keep(
    q: torch.Tensor,
    cp: CPGroup,
    layout: Layout,
    comm_type: str,
    dropout_p: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's share of the whole sequence's keep-mask [b, heads, S, S] (drawn when None),
    in the order its comm type computes: p2p and all_gather, this rank's query rows with the
    key columns in rank order (each rank's block a column slice); a2a, this rank's heads after
    the all-to-all, rows and columns in global order."""
    b, heads, s_local, _ = q.shape
    seq_len = s_local * cp.size
    shape = (b, heads, seq_len, seq_len)
    if mask is None:
        mask = torch.rand(shape, device=q.device) >= dropout_p
    if tuple(mask.shape) != shape or mask.dtype != torch.bool:
        raise ValueError(
            f"dropout_mask must be the whole sequence's bool keep-mask {list(shape)} [b, heads, "
            f"S, S]; got {mask.dtype} {list(mask.shape)}"
        )
    mask = mask.to(q.device)
    everyone = torch.cat(layout.positions)
    if not torch.equal(torch.sort(everyone).values, torch.arange(seq_len)):
        raise ValueError(
            "attention dropout indexes its keep-mask by global position: the CP ranks' "
            f"positions must be 0..{seq_len - 1}, each once"
        )
    if comm_type == "a2a":
        per_rank = heads // cp.size
        mask = mask[:, cp.rank * per_rank : (cp.rank + 1) * per_rank]
        rows = cols = torch.sort(everyone).values
    else:
        rows = layout.positions[cp.rank]
        cols = everyone
    if not torch.equal(rows, torch.arange(seq_len)):
        mask = mask[:, :, rows.to(q.device)]
    if not torch.equal(cols, torch.arange(seq_len)):
        mask = mask[:, :, :, cols.to(q.device)]
    return mask.contiguous()
