"""The blockwise attention math context-parallel attention runs: one block of queries against
one block of keys and values, with its log-sum-exp, merged into a running result by the
online-softmax rule, and its backward (plain matmuls and an fp32 softmax, the tested
reference; or torch's CPU flash-attention kernels, which return the log-sum-exp the merge
needs). `pair_mask` classifies a pair of sub-blocks from the tokens' global positions (and
document ids): fully visible, partly visible (a boolean mask) or hidden (skipped). The ring
(`context_parallel_ring.py`) and the gathered-K/V attention run these blocks.
"""

from __future__ import annotations

import torch

# a pair of sub-blocks that no query may see: skipped
HIDDEN = "hidden"


def halves(n: int) -> list[slice]:
    """The two chunks of a load-balanced local sequence (one piece when `n` is odd)."""
    return [slice(0, n // 2), slice(n // 2, n)] if n % 2 == 0 and n > 1 else [slice(0, n)]


def pair_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> torch.Tensor | None | str:
    """What queries at global positions `q_pos` ([sq]) may see of keys at `k_pos` ([sk]):
    None (everything), HIDDEN (nothing) or a boolean mask [b or 1, 1, 1, sq, sk] (True = may
    attend) broadcasting over [b, groups, heads per group, sq, sk]. Documents ([b, sq], [b, sk])
    restrict it further to pairs in the same document."""
    if q_doc is None and int(q_pos.min()) >= int(k_pos.max()):
        return None
    if int(q_pos.max()) < int(k_pos.min()):
        return HIDDEN
    mask = (q_pos[:, None] >= k_pos[None, :])[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])
    if not bool(mask.any()):
        return HIDDEN
    if bool(mask.all()):
        return None
    return mask[:, None, None]


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, heads per group, s, d] (a view): GQA head i uses group
    i // (heads / groups), so the heads of one group are adjacent."""
    b, h, s, d = x.shape
    return x.view(b, groups, h // groups, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """Masked scores [b, g, h/g, sq, sk] in the accumulation dtype (fp32 or wider)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(_grouped(q, k.shape[1]), k.unsqueeze(2).transpose(-1, -2)).to(acc) * scale
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return s


def _dropped(p: torch.Tensor, keep: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Probabilities p [b, g, h/g, sq, sk] times the block's keep-mask keep [b, h, sq, sk]
    (bool) scaled by 1 / (1 - dropout_p); p itself without a mask."""
    if keep is None:
        return p
    b, g, hg, sq, sk = p.shape
    return p * keep.reshape(b, g, hg, sq, sk).to(p.dtype).mul_(1.0 / (1.0 - dropout_p))


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [b, h, sq, d] over one K/V block [b, g, sk, d]: the normalised
    output [b, h, sq, d] and each row's log-sum-exp [b, h, sq], both in fp32 (-inf and a zero
    output for rows that see nothing of this block). keep ([b, h, sq, sk] bool): attention
    dropout's mask of this block (flash attention's rule: the log-sum-exp is the undropped
    softmax's, only the numerator P * keep / (1 - dropout_p) is dropped)."""
    s = _scores(q, k, scale, mask)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    numerator = _dropped(p, keep, dropout_p)
    out = torch.matmul(numerator, v.unsqueeze(2).to(p.dtype)) / torch.where(total == 0, 1.0, total)
    lse = (m + torch.log(total)).squeeze(-1)
    b, h, sq, d = q.shape
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Online softmax: fold a block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(part * torch.exp(part_lse - safe)[..., None])
    lse.copy_(new)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mask,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fp32) of one block's share of the attention: the block's probabilities are
    recomputed from the final log-sum-exp `lse` [b, h, sq]; `delta` = rowsum(dout * out), of
    the final (dropped-out) output. keep: the block's dropout mask, as in `block_forward`
    (dV = (P * keep / (1 - p))^T dO, dP = (dO V^T) * keep / (1 - p))."""
    g = k.shape[1]
    s = _scores(q, k, scale, mask)
    lse = _grouped(lse.unsqueeze(-1), g)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
    do = _grouped(dout, g).to(p.dtype)
    b, _, hg, sq, sk = p.shape
    d = q.shape[-1]
    # dV: sum over the group's heads of P^T dO, as one matmul over (heads, rows)
    dropped = _dropped(p, keep, dropout_p).reshape(b, g, hg * sq, sk)
    dv = torch.matmul(dropped.transpose(-1, -2), do.reshape(b, g, hg * sq, d))
    dp = _dropped(torch.matmul(do, v.unsqueeze(2).transpose(-1, -2).to(p.dtype)), keep, dropout_p)
    ds = p * (dp - _grouped(delta.unsqueeze(-1), g)) * scale
    dq = torch.matmul(ds, k.unsqueeze(2).to(ds.dtype)).reshape(q.shape)
    q_rows = _grouped(q, g).reshape(b, g, hg * sq, d).to(ds.dtype)
    dk = torch.matmul(ds.reshape(b, g, hg * sq, sk).transpose(-1, -2), q_rows)
    return dq, dk, dv


# The same two blocks through torch's CPU flash-attention kernels, which return the log-sum-exp
# and take it back (private aten ops: used only when present; the functions above are the
# reference they are tested against). GQA is native; a mask is additive, in q's dtype.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def fused_blocks_available(q: torch.Tensor) -> bool:
    return (
        _CPU_FLASH is not None
        and _CPU_FLASH_BACKWARD is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    )


def _kernel_mask(mask, q: torch.Tensor, sk: int) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, additive mask) for the flash kernel: a plain lower-triangular mask (the
    diagonal chunk) is its causal mode, which skips the upper half instead of masking it."""
    if mask is None:
        return False, None
    sq = q.shape[2]
    m = mask[:, :, 0]  # [B, 1, sq, sk]
    if sq == sk and m.shape[0] == 1 and torch.equal(m[0, 0], _tril(sq, m.device)):
        return True, None
    return False, torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, -torch.inf)


def _tril(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def fused_block_forward(q, k, v, scale: float, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` through the flash kernel (same results, to rounding)."""
    causal, additive = _kernel_mask(mask, q, k.shape[2])
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    lse = lse.to(acc)
    if additive is not None:  # the kernel gives 0, not -inf, to rows that see nothing
        lse = lse.masked_fill(~mask[:, :, 0].any(-1), -torch.inf)
    return out.to(acc), lse


def fused_block_backward(q, k, v, dout, out, lse, scale: float, mask):
    """`block_backward` through the flash kernel: it recomputes the block's probabilities from
    the final `lse` and takes rowsum(dout * out) from the final output `out`."""
    causal, additive = _kernel_mask(mask, q, k.shape[2])
    grads = _CPU_FLASH_BACKWARD(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=additive, scale=scale
    )
    acc = torch.promote_types(q.dtype, torch.float32)
    return tuple(g.to(acc) for g in grads)


# --------------------------------------------------------------------------------------------
# The ring.
# --------------------------------------------------------------------------------------------
