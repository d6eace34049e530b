"""The planner with context parallelism: CP's terms written out by hand (compute, activations
and gradient reduction divided or shared over CP, the ring's exposed transfers, the
all-gather's and the all-to-alls' bytes), its memory is MemoryModel's at S / CP, layouts that
cannot split the sequence are rejected with the reason, and long sequences pick CP."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megapipe.config import ModelConfig
from megapipe.planning.cluster import GIB, Cluster
from megapipe.planning.layout import Layout
from megapipe.planning.memory import layout_memory
from megapipe.planning.search import PlanOptions, default_context_parallel, plan
from megapipe.planning.time_model import TimeKnobs, step_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import plan as plan_tool  # noqa: E402

S, H, A, G, L = 8192, 256, 8, 2, 4
MODEL = ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=A, num_query_groups=G,
                    vocab_size=1000, seq_length=S)  # fmt: skip
NODE = Cluster("test", gpus_per_node=8, nodes=1, memory_bytes=80 * GIB, peak_tflops=100.0,
               intra_node_gbps=100.0, inter_node_gbps=10.0, matmul_efficiency=0.5,
               collective_latency_us=20.0)  # fmt: skip
RATE = 100e12 * 0.5
ALPHA = 20e-6
D = H // A  # head size


def _core_forward_seconds(b: int) -> float:
    """The causal attention core's forward FLOPs (QK^T and PV, halved), over the whole
    sequence, at the test's rate."""
    return 2 * b * S * S * H / RATE


@pytest.mark.parametrize("gbps", [100.0, 0.05], ids=["fast-link-hidden", "slow-link-exposed"])
def test_the_rings_exposed_transfers_by_hand(gbps: float) -> None:
    cp, b, m = 2, 1, 4
    cluster = dataclasses.replace(NODE, intra_node_gbps=gbps)
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=b, cp=cp)
    t = step_time(MODEL, layout, cluster, m)
    kv = 2 * S // cp * b * G * D * 2  # this rank's K and V, bf16
    grads = 2 * S // cp * b * G * D * 4 / (gbps * 1e9) + ALPHA  # fp32 dK, dV
    send = kv / (gbps * 1e9) + ALPHA
    block = _core_forward_seconds(b) / cp**2
    forward = (cp - 1) * max(0.0, send - block)
    backward = (cp - 1) * max(0.0, send + grads - 2 * block) + grads
    assert t.cp_comm == pytest.approx(m * L * (forward + backward))
    if gbps == 100.0:
        assert forward == 0.0  # fully under the block attention: only the last hop home shows
    without_overlap = step_time(MODEL, layout, cluster, m, TimeKnobs(cp_overlap=False))
    expected = (cp - 1) * send + (cp - 1) * (send + grads) + grads
    assert without_overlap.cp_comm == pytest.approx(m * L * expected)
    assert "CP comm" in t.terms() and t.total == pytest.approx(sum(t.terms().values()))


def test_all_gather_and_a2a_bytes_by_hand() -> None:
    cp, b, m = 4, 1, 2
    for comm_type in ("all_gather", "a2a"):
        layout = Layout(tp=2, pp=1, dp=1, micro_batch=b, cp=cp, cp_comm_type=comm_type)
        t = step_time(MODEL, layout, NODE, m)
        local = S // cp * b * D // 2  # one head's worth of this rank's tokens, per TP rank
        if comm_type == "all_gather":  # gather K and V; reduce-scatter their gradients
            one_way = (cp - 1) * 2 * local * G * 2 / 100e9 + 2 * ALPHA
        else:  # q, k, v and the output: (cp - 1) / cp of them each way
            one_way = (cp - 1) / cp * local * 2 * (A + G) * 2 / 100e9 + 4 * ALPHA
        assert t.cp_comm == pytest.approx(m * L * 2 * one_way), comm_type
        recompute = step_time(MODEL, dataclasses.replace(layout, recompute="selective"), NODE, m)
        assert recompute.cp_comm == pytest.approx(m * L * 3 * one_way), comm_type


def test_compute_activations_and_gradients_shared_over_cp() -> None:
    one = Layout(tp=1, pp=1, dp=1, micro_batch=1)
    cp2 = dataclasses.replace(one, cp=2)
    t1, t2 = step_time(MODEL, one, NODE, 4), step_time(MODEL, cp2, NODE, 4)
    assert t2.compute == pytest.approx(t1.compute / 2)  # each rank half the tokens
    assert t2.world_size == 2 and t2.flops == t1.flops
    params = layout_memory(MODEL, one, 4).parameters
    assert t2.dp_comm == pytest.approx(2 * 1 / 2 * params * 4 / 100e9 + ALPHA)  # over CP
    no_dropout = dataclasses.replace(MODEL, attention_dropout=0.0)
    m1, m2 = layout_memory(no_dropout, one, 4), layout_memory(no_dropout, cp2, 4)
    assert m2.activations < 0.55 * m1.activations  # S / CP tokens (+ rope-free extras)
    assert m2.params == m1.params and m2.grads == m1.grads
    # GPUs drop inside the attention kernel at one rank (no mask kept); under CP every rank
    # keeps its rows of the layout-invariant keep-mask, a bool [b, a, S/CP, S] per layer
    dropout = layout_memory(MODEL, cp2, 4)
    assert dropout.activations - m2.activations == L * A * (S // 2) * S
    assert layout_memory(MODEL, one, 4).activations == m1.activations
    zero1_cp2 = layout_memory(MODEL, dataclasses.replace(cp2, sharding="optim"), 4)
    zero1_dp2 = layout_memory(MODEL, Layout(tp=1, pp=1, dp=2, sharding="optim"), 4)
    assert zero1_cp2.optimizer == pytest.approx(zero1_dp2.optimizer)  # sharded over DP x CP
    tp2 = Layout(tp=2, pp=1, dp=1)
    assert (
        step_time(MODEL, dataclasses.replace(tp2, cp=2), NODE, 4).tp_comm
        < step_time(MODEL, tp2, NODE, 4).tp_comm
    )  # TP's all-reduces move S / CP tokens


def test_sequences_that_do_not_split_are_rejected_with_the_reason() -> None:
    odd = dataclasses.replace(MODEL, seq_length=8196, num_query_groups=8)
    options = PlanOptions(micro_batches=(1,), context_parallel=(1, 2, 4),
                          cp_comm_types=("p2p", "a2a"), recompute=("none",))  # fmt: skip
    result = plan(odd, NODE, 8, options)
    reasons = {(r.category, r.what): r.reason for r in result.rejected}
    assert reasons[("seq % 2CP", "TP1 CP4")] == "sequence (8196) not divisible by 2 x CP (8)"
    assert ("seq % 2CP", "TP1 CP2") not in reasons  # 8196 = 4 x 2049
    assert any(e.layout.cp == 2 for e in result.ranked)
    heads = plan(MODEL, NODE, 8, dataclasses.replace(options, context_parallel=(4,)))
    reasons = {(r.category, r.what): r.reason for r in heads.rejected}
    assert reasons[("heads % CP (a2a)", "TP2 CP4 (a2a)")] == (
        "heads (4) and query groups (1) per TP rank not divisible by CP (4)"
    )
    assert all(e.layout.cp == 4 for e in heads.ranked)
    assert not any(e.layout.cp_comm_type == "a2a" and e.layout.tp == 2 for e in heads.ranked)


def test_long_sequences_search_cp_by_default_and_pick_it() -> None:
    assert default_context_parallel(2048) == (1,)
    assert default_context_parallel(32768) == (1, 2, 4, 8)
    # long-context runs turn attention dropout off: under CP its layout-invariant masks keep a
    # bool [b, a, S/CP, S] per layer, which would rule CP out here
    long = dataclasses.replace(MODEL, seq_length=65536, num_layers=8, hidden_size=1024,
                               num_attention_heads=8, num_query_groups=8,
                               attention_dropout=0.0)  # fmt: skip
    small_gpus = dataclasses.replace(NODE, memory_bytes=16 * GIB)
    options = PlanOptions(micro_batches=(1,), sharding=("no_shard", "optim"))
    searched = plan(long, small_gpus, 2, options)
    top = searched.ranked[0]
    assert top.layout.cp > 1, top.layout.describe()
    without = plan(long, small_gpus, 2, dataclasses.replace(options, context_parallel=(1,)))
    assert not without.ranked or without.ranked[0].time.total > top.time.total


def test_cli_context_parallel_flags(capsys) -> None:
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "8192", "--vocab-size", "1000", "--global-batch-size", "2",
            "--gpus-per-node", "2", "--nodes", "1", "--top", "200",
            "--micro-batch-sizes", "1"]  # fmt: skip
    assert plan_tool.main(argv + ["--context-parallel-sizes", "1,2",
                                  "--cp-comm-types", "p2p,a2a"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert " CP2 PP" in out and " CP2 (a2a) PP" in out and " CP4" not in out
    assert "CP comm" in out
    with pytest.raises(SystemExit) as exit_info:
        plan_tool.main(argv + ["--cp-comm-types", "ring"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--cp-comm-types" in err and "ring" in err
