"""Context-parallel attention (megapipe/model/context_parallel.py) against whole-sequence
attention on one process: values and gradients, every comm type, CP 2 and 4, GQA, packed
documents, a custom layout, a CP group inside a larger world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.data.context_parallel_split import chunk_positions, split_sequence
from megapipe.model import context_parallel_blocks as blocks
from megapipe.model.context_parallel import (
    COMM_TYPES,
    context_parallel_attention,
    gather_from_cp,
)
from megapipe.model.context_parallel_ring import CPGroup, Layout
from megapipe.parallel.state import Group
from megapipe.testing import run_distributed

B, D = 2, 8
HEAD_GROUPS = ((4, 4), (4, 2), (8, 4))  # (heads, query groups): MHA and GQA
TOLERANCE = 1e-5  # fp32
CASES = ("causal", "documents", "positions")  # positions: a contiguous split, given explicitly


# --------------------------------------------------------------------------------------------
# Layout.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seq_len", [48, 96])
def test_chunk_positions_cover_once_with_equal_causal_work(cp, seq_len):
    held = [chunk_positions(seq_len, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq_len))
    # (q, k) pairs with q >= k: a query at position p sees p + 1 keys
    work = {int((idx + 1).sum()) for idx in held}
    assert len(work) == 1, work
    c = seq_len // (2 * cp)
    for r, idx in enumerate(held):  # chunk r, then chunk 2*cp-1-r, each in order
        if cp > 1:
            assert idx[0] == r * c and idx[c] == (2 * cp - 1 - r) * c
        assert torch.equal(idx[1:c] - idx[: c - 1], torch.ones(c - 1, dtype=torch.long))


def test_chunk_positions_errors():
    with pytest.raises(ValueError, match=r"32 does not split into 2 x 3 equal chunks"):
        chunk_positions(32, 3, 0)
    with pytest.raises(ValueError, match="context-parallel rank 2 of a group of 2"):
        chunk_positions(32, 2, 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_skips_invisible_blocks_evenly(cp):
    """Over the ring's steps each rank computes 2*CP+1 of the (query chunk, key chunk) pairs,
    one of them diagonal (masked): the same work everywhere, half the blocks skipped."""
    seq_len = 8 * cp
    layout = Layout([chunk_positions(seq_len, cp, r) for r in range(cp)], None)
    for rank in range(cp):
        pairs = [p for src in range(cp) for p in layout.pairs(rank, src, seq_len // cp)]
        assert len(pairs) == 2 * cp + 1
        assert sum(mask is not None for _, _, mask in pairs) == 2  # each chunk's diagonal


def test_split_sequence_takes_the_ranks_chunks():
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    part = split_sequence(x, 4, 1, dim=1)
    assert torch.equal(part[:, :, 0] // 3 % 16, torch.tensor([[2, 3, 12, 13]] * 2))


# --------------------------------------------------------------------------------------------
# Reference and inputs.
# --------------------------------------------------------------------------------------------


def _documents(seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[B, S] document ids: row 0 fixed cuts off the chunk grid, row 1 random cuts."""
    starts = torch.zeros(B, seq_len, dtype=torch.long)
    starts[0, [seq_len // 3, seq_len // 2 + 1, seq_len - 3]] = 1
    starts[1, torch.randperm(seq_len - 1, generator=gen)[:4] + 1] = 1
    return starts.cumsum(1)


def _reference(q, k, v, scale, docs):
    """Whole-sequence causal attention (block-diagonal causal with documents)."""
    if docs is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    seq_len = q.shape[2]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril() & (
        docs[:, :, None] == docs[:, None]
    )
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def _case(seq_len, heads, groups, case, cp_size, cp_rank, seed):
    """Full inputs and reference (the same on every rank), this rank's indices and inputs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, seq_len, D, generator=gen)
    k, v = (torch.randn(B, groups, seq_len, D, generator=gen) for _ in range(2))
    dout = torch.randn(B, heads, seq_len, D, generator=gen)
    docs = _documents(seq_len, gen) if case == "documents" else None
    scale = D**-0.5
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*full, scale, docs)
    ref_grads = torch.autograd.grad(ref, full, dout)
    if case == "positions":
        s = seq_len // cp_size
        idx = torch.arange(cp_rank * s, (cp_rank + 1) * s)
    else:
        idx = chunk_positions(seq_len, cp_size, cp_rank)
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    kwargs = {
        "scale": scale,
        "positions": idx if case == "positions" else None,
        "document_ids": None if docs is None else docs[:, idx],
    }
    expected = [ref.detach()[:, :, idx]] + [g[:, :, idx] for g in ref_grads]
    return local, dout[:, :, idx], kwargs, expected


def _diffs(got, expected) -> dict[str, float]:
    return {
        n: float((a - b).abs().max()) for n, a, b in zip(("out", "dq", "dk", "dv"), got, expected)
    }


def _run(q, k, v, dout, group, comm_type, **kwargs):
    out = context_parallel_attention(q, k, v, group, comm_type=comm_type, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _group(cp_ranks: list[list[int]]) -> Group:
    me = dist.get_rank()
    mine = None
    for ranks in cp_ranks:  # every rank creates every group, in the same order
        pg = dist.new_group(ranks)
        if me in ranks:
            mine = Group(tuple(ranks), ranks.index(me), pg)
    return mine


def _cases(rank, world, comm_type, cp_ranks, seq_lens):
    group = _group(cp_ranks)
    results, overlap_equal = {}, True
    for seq_len in seq_lens:
        for heads, groups in HEAD_GROUPS:
            if comm_type == "a2a" and groups % group.size:
                continue  # refused (test_a2a_needs_heads_and_groups_divisible_by_cp)
            for case in CASES:
                seed = seq_len * 1000 + heads * 100 + groups * 10 + CASES.index(case)
                local, dout, kwargs, expected = _case(
                    seq_len, heads, groups, case, group.size, group.rank, seed
                )
                got = _run(*local, dout, group, comm_type, **kwargs)
                results[(seq_len, f"{heads}/{groups}", case)] = _diffs(got, expected)
                if comm_type == "p2p":
                    waited = _run(*local, dout, group, comm_type, overlap=False, **kwargs)
                    overlap_equal &= all(torch.equal(a, b) for a, b in zip(got, waited))
                    plain = _run(*local, dout, group, comm_type, block_kernel="reference", **kwargs)
                    results[(seq_len, f"{heads}/{groups}", f"{case}, reference blocks")] = _diffs(
                        plain, expected
                    )
    # gather_from_cp puts the shares back in global order
    x = torch.arange(B * 32).reshape(B, 32)
    back = gather_from_cp(split_sequence(x, group.size, group.rank, 1), group, 1)
    return results, overlap_equal, torch.equal(back, x)


def _check(per_rank, comm_type, cp):
    worst: dict = {}  # (seq, heads/groups, case, tensor) -> max |diff| over ranks
    for results, overlap_equal, gathered in per_rank:
        assert gathered
        assert overlap_equal, "p2p with overlap on and off differ"
        for key, diffs in results.items():
            for name, value in diffs.items():
                worst[(*key, name)] = max(worst.get((*key, name), 0.0), value)
    print(f"\n{comm_type} CP={cp}, max |diff| over ranks, sequences and head/group counts:")
    for case in sorted({key[2] for key in worst}):
        cells = [
            f"{name} {max(v for k, v in worst.items() if k[2] == case and k[3] == name):.1e}"
            for name in ("out", "dq", "dk", "dv")
        ]
        print(f"  {case:28} " + "  ".join(cells))
    bad = {key: value for key, value in worst.items() if not value < TOLERANCE}
    assert not bad, bad


# --------------------------------------------------------------------------------------------
# Equality with the reference.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("cp", [2, 4])
def test_matches_whole_sequence_attention(comm_type, cp):
    per_rank = run_distributed(_cases, cp, comm_type, [list(range(cp))], (32, 64), timeout=120)
    _check(per_rank, comm_type, cp)


@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_cp_group_inside_a_larger_world(comm_type):
    """CP groups {0, 2} and {1, 3} of a world of 4: the ring addresses global ranks."""
    per_rank = run_distributed(_cases, 4, comm_type, [[0, 2], [1, 3]], (32,), timeout=120)
    _check(per_rank, comm_type, 2)


@pytest.mark.parametrize(
    ("comm_type", "block_kernel"),
    [("p2p", "fused"), ("p2p", "reference"), ("all_gather", "auto"), ("a2a", "auto")],
)
def test_single_rank_is_plain_attention(comm_type, block_kernel):
    for case in CASES:
        local, dout, kwargs, expected = _case(32, 4, 2, case, 1, 0, seed=7)
        got = _run(*local, dout, None, comm_type, block_kernel=block_kernel, **kwargs)
        assert max(_diffs(got, expected).values()) < TOLERANCE


@pytest.mark.parametrize("block_kernel", ["fused", "reference"])
def test_float64(block_kernel):
    local, dout, kwargs, expected = _case(32, 4, 2, "documents", 1, 0, seed=3)
    local = [x.detach().double().requires_grad_() for x in local]
    q, k, v = (x.detach() for x in local)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*full, kwargs["scale"], kwargs["document_ids"])
    expected = [ref.detach(), *torch.autograd.grad(ref, full, dout.double())]
    got = _run(*local, dout.double(), None, "p2p", block_kernel=block_kernel, **kwargs)
    assert got[0].dtype == torch.float64
    assert max(_diffs(got, expected).values()) < 1e-12


def test_fused_block_matches_reference_block_with_a_row_that_sees_nothing():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, D, generator=gen, dtype=torch.float64) for _ in "kv")
    mask = torch.rand(2, 1, 1, 6, 5, generator=gen) > 0.4
    mask[0, :, :, 2] = False  # query 2 of sample 0 sees no key of this block
    out, lse = blocks.block_forward(q, k, v, 0.5, mask)
    fused_out, fused_lse = blocks.fused_block_forward(q, k, v, 0.5, mask)
    assert torch.isneginf(lse[0, :, 2]).all() and torch.isneginf(fused_lse[0, :, 2]).all()
    torch.testing.assert_close(fused_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused_lse, lse, rtol=0, atol=1e-12)
    # gradients against a final lse that includes another block's mass (finite everywhere)
    final = torch.logaddexp(lse, torch.randn(lse.shape, generator=gen, dtype=lse.dtype))
    dout = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    full_out = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    delta = (dout * full_out).sum(-1)
    expected = blocks.block_backward(q, k, v, dout, final, delta, 0.5, mask)
    got = blocks.fused_block_backward(q, k, v, dout, full_out, final, 0.5, mask)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Errors (raised before any communication, so a fake group of 4 needs no processes).
# --------------------------------------------------------------------------------------------


def _fake_cp4() -> CPGroup:
    return CPGroup(None, 0, 4, (0, 1, 2, 3))


@pytest.mark.parametrize(("heads", "groups"), [(6, 2), (4, 2)])
def test_a2a_needs_heads_and_groups_divisible_by_cp(heads, groups):
    q = torch.randn(1, heads, 8, D)
    k = torch.randn(1, groups, 8, D)
    match = (
        rf"heads \({heads}\) and query groups \({groups}\) divisible by the context-parallel size"
    )
    match += r" \(4\)"
    with pytest.raises(ValueError, match=match):
        context_parallel_attention(q, k, k, _fake_cp4(), comm_type="a2a", scale=1.0)


def test_other_errors():
    q, k = torch.randn(1, 4, 8, D), torch.randn(1, 2, 8, D)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        context_parallel_attention(q, k, k, None, comm_type="p2p", scale=1.0, dropout_p=1.5)
    with pytest.raises(ValueError, match="block_kernel 'flash'"):
        context_parallel_attention(q, k, k, None, comm_type="p2p", scale=1.0, block_kernel="flash")
    with pytest.raises(ValueError, match="comm_type 'ring'"):
        context_parallel_attention(q, k, k, None, comm_type="ring", scale=1.0)
    with pytest.raises(ValueError, match=r"heads \(4\) are not divisible by query groups \(3\)"):
        k3 = torch.randn(1, 3, 8, D)
        context_parallel_attention(q, k3, k3, None, comm_type="p2p", scale=1.0)
    with pytest.raises(ValueError, match="local sequence length 7 is odd"):
        q7, k7 = torch.randn(1, 4, 7, D), torch.randn(1, 2, 7, D)
        context_parallel_attention(q7, k7, k7, _fake_cp4(), comm_type="p2p", scale=1.0)
