"""Attention dropout under context parallelism against plain PyTorch on the whole sequence.

Every comm type at CP 2 (and p2p at CP 4), dropout 0.1, MHA and GQA, causal and packed
documents: each CP rank's output rows and its dq / dk / dv equal those of softmax -> the same
whole-sequence keep-mask [b, heads, S, S] -> matmul on one process, to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from megapipe.data.context_parallel_split import chunk_positions
from megapipe.model.context_parallel import COMM_TYPES, context_parallel_attention
from megapipe.model.dropout import logical_keep_mask
from megapipe.testing import run_distributed

B, D, SEQ = 2, 8, 32
P = 0.1
HEAD_GROUPS = ((4, 4), (4, 2))
TOLERANCE = 1e-5  # fp32


def _documents(gen: torch.Generator) -> torch.Tensor:
    """[B, S] document ids with cuts off the chunk grid."""
    starts = torch.zeros(B, SEQ, dtype=torch.long)
    starts[0, [SEQ // 3, SEQ // 2 + 1, SEQ - 3]] = 1
    starts[1, torch.randperm(SEQ - 1, generator=gen)[:4] + 1] = 1
    return starts.cumsum(1)


def _keep(heads: int, seed: int) -> torch.Tensor:
    """The whole sequence's keep-mask [B, heads, S, S], one logical mask per sample."""
    return torch.stack(
        [logical_keep_mask(seed, i, 0, "attention_probs", (heads, SEQ, SEQ), P) for i in range(B)]
    )


def _reference(q, k, v, keep, docs) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal [within documents]) * keep / (1 - p) @ v, plain torch."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if docs is not None:
        allowed = allowed & (docs[:, :, None] == docs[:, None])[:, None]
    scores = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) * keep / (1 - P)) @ v


def _case(heads: int, groups: int, documents: bool, cp: int, rank: int, seed: int):
    """Whole-sequence inputs, reference output and gradients, and this rank's share."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, SEQ, D, generator=gen)
    k, v = (torch.randn(B, groups, SEQ, D, generator=gen) for _ in "kv")
    dout = torch.randn(B, heads, SEQ, D, generator=gen)
    docs = _documents(gen) if documents else None
    keep = _keep(heads, seed)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*full, keep, docs)
    expected = [ref.detach(), *torch.autograd.grad(ref, full, dout)]
    no_dropout = _reference(q, k, v, torch.ones_like(keep), docs)
    idx = chunk_positions(SEQ, cp, rank)
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    kwargs = {"document_ids": None if docs is None else docs[:, idx], "dropout_mask": keep}
    return local, dout[:, :, idx], kwargs, [e[:, :, idx] for e in expected], no_dropout[:, :, idx]


def _worst(rank: int, world: int, comm_type: str) -> dict[str, float]:
    """Max |difference| from the reference per case on this rank, and whether dropout moved
    the output at all (a control)."""
    group = torch.distributed.group.WORLD if world > 1 else None
    worst: dict[str, float] = {}
    for heads, groups in HEAD_GROUPS:
        for documents in (False, True):
            seed = 100 * heads + 10 * groups + documents
            local, dout, kwargs, expected, no_dropout = _case(
                heads, groups, documents, world, rank, seed
            )
            out = context_parallel_attention(
                *local, group, comm_type=comm_type, scale=D**-0.5, dropout_p=P, **kwargs
            )
            got = [out.detach(), *torch.autograd.grad(out, local, dout)]
            name = f"{heads}/{groups}{' documents' if documents else ''}"
            for tensor, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
                worst[f"{name} {tensor}"] = float((a - b).abs().max())
            worst[f"{name} moved"] = float((got[0] - no_dropout).abs().max())
    return worst


@pytest.mark.parametrize(
    ("comm_type", "cp"), [("p2p", 2), ("all_gather", 2), ("a2a", 2), ("p2p", 4), ("p2p", 1)]
)
def test_dropout_matches_whole_sequence_reference(comm_type: str, cp: int) -> None:
    per_rank = (
        run_distributed(_worst, cp, comm_type, timeout=120) if cp > 1 else [_worst(0, 1, comm_type)]
    )
    for worst in per_rank:
        moved = {k: v for k, v in worst.items() if k.endswith("moved")}
        diffs = {k: v for k, v in worst.items() if not k.endswith("moved")}
        print(f"\n{comm_type} CP={cp}: max |diff| {max(diffs.values()):.1e}")
        assert all(v > 1e-2 for v in moved.values()), moved
        assert all(v < TOLERANCE for v in diffs.values()), diffs


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_one_rank_dropout_without_a_mask_draws_one(comm_type: str) -> None:
    """No dropout_mask: drawn from the default generator, so the same seed gives the same
    result (and the output differs from no dropout)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, D, generator=gen) for _ in "qkv")
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(
            context_parallel_attention(q, k, v, None, comm_type=comm_type, scale=1.0, dropout_p=P)
        )
    plain = context_parallel_attention(q, k, v, None, comm_type=comm_type, scale=1.0)
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], plain)


def test_dropout_errors() -> None:
    q = torch.randn(1, 4, 8, D)
    with pytest.raises(ValueError, match="block_kernel 'fused' with attention dropout"):
        context_parallel_attention(
            q, q, q, None, comm_type="p2p", scale=1.0, dropout_p=P, block_kernel="fused"
        )
    with pytest.raises(ValueError, match=r"keep-mask \[1, 4, 8, 8\]"):
        context_parallel_attention(
            q, q, q, None, comm_type="p2p", scale=1.0, dropout_p=P,
            dropout_mask=torch.ones(1, 4, 8, 4, dtype=torch.bool),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        context_parallel_attention(q, q, q, None, comm_type="a2a", scale=1.0, dropout_p=1.0)
