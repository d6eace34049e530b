"""The context-parallel ring (p2p) under NCCL's ordering, and ring failures that name the peer.

On NCCL the point-to-point operations between two ranks run on one stream in posting order:
the ring's send posted on its own before its receive deadlocks at CP=2 (next == previous
rank), which gloo forgives. The ring posts each transfer as one batch; `--emulate-nccl-p2p-
order` runs gloo in NCCL's order (`parallel/emulated_stream.py`), so the old posting order is
caught on the CPU (the negative control below), and a transfer that does not complete raises
ContextParallelCommError naming the pass, the step and the CP peer with its global rank.
"""

from __future__ import annotations

import importlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.arguments import parse_args
from megapipe.data.context_parallel_split import chunk_positions
from megapipe.errors import ConfigError, ContextParallelCommError
from megapipe.model import context_parallel_ring as ring
from megapipe.model.context_parallel import context_parallel_attention
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group
from megapipe.testing import run_distributed
from tests.helpers import argv

B, HEADS, GROUPS, D, SEQ = 2, 4, 2, 8, 32
TOLERANCE = 1e-5  # fp32, against whole-sequence SDPA
# the one-queue emulation's dispatch mode needs torch._dynamo (~3 s to import): once, before
# forking, so that the failure tests time the ring and not the import
importlib.import_module("torch._dynamo")
TIMEOUT_S = 1.5  # a ring transfer's limit in the failure tests


def _inputs(cp_size: int, cp_rank: int, seed: int = 0):
    """This rank's q, k, v (leaves), dout, and the whole-sequence SDPA's output and gradients
    at this rank's positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, SEQ, D, generator=gen)
    k, v = (torch.randn(B, GROUPS, SEQ, D, generator=gen) for _ in range(2))
    dout = torch.randn(B, HEADS, SEQ, D, generator=gen)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=D**-0.5, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, full, dout)
    idx = chunk_positions(SEQ, cp_size, cp_rank)
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    expected = [ref.detach()[:, :, idx]] + [g[:, :, idx] for g in ref_grads]
    return local, dout[:, :, idx], expected


def _attention(local, dout, group, **kwargs) -> list[torch.Tensor]:
    """Output and gradients of the ring attention."""
    out = context_parallel_attention(*local, group, comm_type="p2p", scale=D**-0.5, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, local, dout)]


def _world_group(rank: int, world: int) -> Group:
    return Group(tuple(range(world)), rank, dist.group.WORLD)


# --------------------------------------------------------------------------------------------
# (a) The batched ring in NCCL's order computes what plain gloo and SDPA compute.
# --------------------------------------------------------------------------------------------


def _compare(rank: int, world: int) -> dict:
    group = _world_group(rank, world)
    local, dout, expected = _inputs(world, rank)
    results = {}
    for overlap, kernel in ((True, "auto"), (False, "reference")):
        kw = {"overlap": overlap, "block_kernel": kernel}
        gloo = _attention(local, dout, group, **kw)
        nccl = _attention(local, dout, group, emulate_nccl_order=True, timeout_s=20, **kw)
        results[(overlap, kernel)] = (
            all(torch.equal(a, b) for a, b in zip(gloo, nccl)),
            max(float((a - b).abs().max()) for a, b in zip(nccl, expected)),
        )
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_in_nccl_order_equals_plain_gloo_and_sdpa(cp):
    for per_rank in run_distributed(_compare, cp, timeout=60):
        for (overlap, kernel), (equal, diff) in per_rank.items():
            assert equal, f"NCCL order changed the result (overlap {overlap}, {kernel} blocks)"
            assert diff < TOLERANCE, (overlap, kernel, diff)


# --------------------------------------------------------------------------------------------
# (b) Negative control: the old posting (each send and receive on its own) hangs in NCCL's
# order at CP=2 and now times out; plain gloo forgives it; at CP=4 the send and the receive
# go to different peers (torch's NCCL backend: a communicator per pair), which NCCL runs.
# --------------------------------------------------------------------------------------------


def _unbatched(rank: int, world: int, emulate):
    ring._Ring.grouped = False  # this forked rank only: the posting before the batches
    group = _world_group(rank, world)
    local, dout, expected = _inputs(world, rank)
    start = time.monotonic()
    try:
        got = _attention(local, dout, group, emulate_nccl_order=emulate, timeout_s=TIMEOUT_S)
    except ContextParallelCommError as error:
        return "error", str(error), time.monotonic() - start
    return "ok", max(float((a - b).abs().max()) for a, b in zip(got, expected)), 0.0


def test_unbatched_ring_times_out_in_nccl_order_at_cp2():
    results = run_distributed(_unbatched, 2, True)
    for rank, (status, message, seconds) in enumerate(results):
        assert status == "error", f"rank {rank}: the emulation let a NCCL deadlock pass"
        peer = 1 - rank
        assert message.startswith("context-parallel ring (p2p) forward step 0: "), message
        assert f"CP rank {peer} (global rank {peer})" in message, message
        assert seconds < 3 * TIMEOUT_S, seconds
    # the first rank to give up timed out; its peer may see the connection it closed instead
    assert any(f"timed out after {TIMEOUT_S:g} s" in message for _, message, _ in results)


@pytest.mark.parametrize(
    ("cp", "emulate"), [(2, False), (4, ("streams",))], ids=["cp2-gloo", "cp4-streams"]
)
def test_unbatched_ring_runs_where_its_transport_allows(cp, emulate):
    for status, diff, _ in run_distributed(_unbatched, cp, emulate, timeout=60):
        assert status == "ok" and diff < TOLERANCE, (status, diff)


@pytest.mark.parametrize("rule", ["handshake", "one-queue"])
def test_unbatched_ring_hangs_at_cp4_under_each_rule_nccl_leaves_open(rule):
    # at CP=4 the send and the receive go to different peers, each over the communicator of
    # its pair (torch's NCCL backend for a lone p2p): every rank's first call is its send, so
    # with lazy connections each waits for its next rank, whose first call is with the rank
    # after (a ring of handshakes), and with one queue each send waits for a receive queued
    # behind the next rank's own send
    results = run_distributed(_unbatched, 4, (rule,), timeout=60)
    assert all(status == "error" for status, _, _ in results), results
    if rule == "handshake":
        assert any("connection handshake" in message for _, message, _ in results)


# --------------------------------------------------------------------------------------------
# (c) A CP peer that never joins (or has exited) is named, with its global rank.
# --------------------------------------------------------------------------------------------


def _peer_missing(rank: int, world: int, how: str, emulate: bool):
    """World of 4, CP groups [0, 2] and [1, 3]; global rank 3 skips the attention."""
    groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    ranks = (0, 2) if rank % 2 == 0 else (1, 3)
    group = Group(ranks, ranks.index(rank), groups[rank % 2])
    local, dout, _ = _inputs(2, group.rank)
    if rank == 3:
        if how == "hangs":
            time.sleep(2.5 * TIMEOUT_S)  # busy elsewhere past the peer's timeout, then gone
        return None
    start = time.monotonic()
    try:
        _attention(local, dout, group, emulate_nccl_order=emulate, timeout_s=TIMEOUT_S)
    except ContextParallelCommError as error:
        return str(error), time.monotonic() - start
    return "ok", 0.0


@pytest.mark.parametrize(
    ("how", "emulate"),
    [("hangs", False), ("hangs", True), ("exits", False)],
    ids=["hangs-gloo", "hangs-nccl-order", "exits-gloo"],
)
def test_missing_cp_peer_is_named(how, emulate):
    results = run_distributed(_peer_missing, 4, how, emulate, timeout=30)
    assert results[0] == results[2] == ("ok", 0.0)  # the other CP group is unaffected
    message, seconds = results[1]
    assert message.startswith("context-parallel ring (p2p) forward step 0: "), message
    assert "CP rank 1 (global rank 3)" in message, message
    assert "this is CP rank 0 of 2, global rank 1" in message, message
    expected = f"timed out after {TIMEOUT_S:g} s" if how == "hangs" else "failed"
    assert f"(global rank 3) {expected} " in message, message
    assert seconds < 2 * TIMEOUT_S, seconds


# --------------------------------------------------------------------------------------------
# The flag reaches the attention.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "rules"),
    [(None, ()), ([], ("handshake", "one-queue")), (["streams"], ("streams",)),
     (["one-queue"], ("one-queue",))],
    ids=["off", "bare", "streams", "one-queue"],
)  # fmt: skip
def test_emulate_flag_reaches_the_attention(flag, rules):
    extra = [] if flag is None else ["--emulate-nccl-p2p-order", *flag]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        configs = parse_args(argv(context_parallel_size=2) + extra, 2)
    assert configs.parallel.emulate_nccl_p2p_order == configs.kernels.emulate_nccl_p2p_order
    assert configs.parallel.emulate_nccl_p2p_order == rules
    layer = TransformerLayer(
        configs.model,
        Group.single(),
        RNGTracker(0),
        sequence_parallel=False,
        kernels=configs.kernels,
        cp=Group((0, 1), 0),
    )
    assert layer.self_attention.cp_emulate_nccl_order == rules


def test_an_unknown_emulation_rule_is_refused_by_name():
    with pytest.raises(ConfigError, match="invalid choice: 'two-streams'"):
        parse_args(argv() + ["--emulate-nccl-p2p-order", "two-streams"], 1)
