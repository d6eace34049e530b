"""The layout planner (megapipe/planning, tools/plan.py): its memory is MemoryModel's, its
schedule numbers are the simulator's, its time terms match a hand computation, it rejects
what cannot run with the reason, and better hardware never makes its choice slower."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megapipe.config import ModelConfig
from megapipe.model.activation_memory import layer_activation_bytes
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import SCHEDULE_KINDS
from megapipe.pipeline.simulator import simulate_kind
from megapipe.planning.cluster import GIB, PRESETS, Cluster
from megapipe.planning.layout import Layout
from megapipe.planning.memory import layout_memory, memory_model, stage_memories
from megapipe.planning.report import format_plan
from megapipe.planning.schedule_model import (
    _extrapolated,
    bubble_fraction,
    in_flight,
    is_closed_form,
)
from megapipe.planning.search import PlanOptions, plan
from megapipe.planning.time_model import TimeKnobs, step_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import plan as plan_tool  # noqa: E402

MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=1000,
                    seq_length=128)  # fmt: skip
SMALL = Cluster("test", gpus_per_node=4, nodes=2, memory_bytes=4 * GIB, peak_tflops=100.0,
                intra_node_gbps=100.0, inter_node_gbps=10.0, matmul_efficiency=0.5,
                collective_latency_us=20.0)  # fmt: skip

LAYOUTS = [
    Layout(tp=1, pp=1, dp=8, micro_batch=2),
    Layout(tp=2, pp=2, dp=2, micro_batch=1, recompute="full", sharding="optim"),
    Layout(tp=1, pp=2, dp=4, micro_batch=2, sharding="optim_grads"),
    Layout(tp=2, pp=2, dp=2, vp=2, sharding="optim_grads_params", schedule="interleaved-1f1b"),
    Layout(tp=1, pp=4, dp=2, micro_batch=2, recompute="selective"),
    Layout(tp=2, pp=2, dp=2, vp=2, micro_batch=1, schedule="interleaved-1f1b"),
    Layout(tp=1, pp=4, dp=1, micro_batch=4, schedule="gpipe"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_memory_is_memory_models_largest_stage(layout: Layout) -> None:
    """Every stage MemoryModel estimates (simulating the schedule itself), and its largest."""
    estimate = memory_model(MODEL, layout, 32)
    everyone = estimate.stages(partition_layers(MODEL, layout.pp, layout.vp))
    ours = stage_memories(MODEL, layout, 32, stages=list(range(layout.pp)))
    assert ours == everyone
    largest = max(everyone, key=lambda s: s.total_bytes)
    got = layout_memory(MODEL, layout, 32)
    assert got.total == largest.total_bytes
    assert (got.params, got.grads, got.optimizer, got.activations, got.gathered) == (
        largest.parameter_bytes, largest.gradient_bytes, largest.optimizer_bytes,
        largest.activation_bytes, largest.gathered_bytes)  # fmt: skip


def test_memory_of_one_stage_is_the_activation_formula_and_bytes_per_parameter() -> None:
    """PP1, bf16 Adam: 2 + 4 + 12 bytes a parameter; activations are the layer formula x
    layers (attention dropout inside the fused kernel, as on GPUs), plus the output layer's
    inputs and fp32 logits, plus the embedding's dropout mask."""
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=2)
    got = layout_memory(MODEL, layout, 32)
    s, b, h, v = 128, 2, 256, MODEL.padded_vocab_size(2)
    layer = layer_activation_bytes(MODEL, b, 2, dtype_bytes=2, attention_dropout_fused=True)
    assert MODEL.attention_dropout > 0 and layer < layer_activation_bytes(
        MODEL, b, 2, dtype_bytes=2
    )
    head = s * b * h * 2 + s * b * 4 * 2 + s * b * h * 2 + s * b * v // 2 * 4 * 2
    assert got.activations == 8 * layer + head + s * b * h * 2
    assert (got.params, got.grads, got.optimizer) == (
        got.parameters * 2, got.parameters * 4, got.parameters * 12)  # fmt: skip
    zero = layout_memory(MODEL, dataclasses.replace(layout, sharding="optim"), 32)
    assert zero.optimizer == got.optimizer / 4


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_closed_forms_are_the_simulators(kind: str, v: int, p: int, m: int) -> None:
    sim = simulate_kind(kind, p, v, m)
    assert in_flight(kind, p, v, m) == sim.peak_in_flight
    assert bubble_fraction(kind, p, v, m) == pytest.approx(sim.bubble_fraction())


SIMULATED = [k for k in SCHEDULE_KINDS if not is_closed_form(k)]


@pytest.mark.skipif(not SIMULATED, reason="every schedule in SCHEDULE_KINDS has a closed form")
@pytest.mark.parametrize("kind", SIMULATED)
def test_simulated_kinds_extrapolate_in_m_and_p(kind: str) -> None:
    """m > 2p is simulated at 2p, p > 16 extrapolated from 8 and 16: both against the truth."""
    v = 2 if "interleaved" in kind else 1
    exact = simulate_kind(kind, 4, v, 20)
    assert bubble_fraction(kind, 4, v, 20) == pytest.approx(exact.bubble_fraction())
    assert in_flight(kind, 4, v, 20) == exact.peak_in_flight
    big = simulate_kind(kind, 20, v, 40)
    idle, flights = _extrapolated(kind, 20, v, 40)
    assert idle == pytest.approx(max(big.idle(r) for r in range(20)))
    assert (flights[0], flights[-1]) == (big.peak_in_flight[0], big.peak_in_flight[-1])


def test_time_terms_by_hand() -> None:
    """TP2 PP2 DP1, 8 micro-batches of 2: compute, bubble, TP and PP bytes written out."""
    layout = Layout(tp=2, pp=2, dp=1, micro_batch=2)
    cluster = dataclasses.replace(SMALL, nodes=1)
    t = step_time(MODEL, layout, cluster, 16)
    s, b, h, V, L = 128, 2, 256, MODEL.padded_vocab_size(2), 8
    T = s * b  # tokens of a micro-batch
    layer = 2 * T * h * 3 * h + 2 * b * s * s * h + 2 * T * h * h + 2 * T * h * 4 * h * 2
    last_stage = 3 * (L // 2 * layer + 2 * T * h * V)  # the last stage also has the logits
    rate = 100e12 * 0.5
    m = 8
    assert t.compute == pytest.approx(m * last_stage / 2 / rate)
    alpha = 20e-6  # each collective's and send's fixed cost
    all_reduce = 2 * (2 - 1) / 2 * (s * b * h * 2) / 100e9 + alpha  # ring, bf16, NVLink

    # Backward all-reduces run while the same linear's weight gradient is computed: only the
    # excess counts. Per layer: 2 forward + QKV's and FC1's; then the output layer's and the
    # cross-entropy's all-gather (its latency).
    def beyond(out_features: int) -> float:
        return max(0.0, all_reduce - 2 * T * h * out_features / 2 / rate)

    tp_per_mb = L // 2 * (2 * all_reduce + beyond(3 * h) + beyond(4 * h)) + beyond(V) + alpha
    assert 0 < beyond(V) <= beyond(4 * h) < beyond(3 * h) < all_reduce  # partly hidden
    assert t.tp_comm == pytest.approx(m * tp_per_mb)
    unhidden = step_time(MODEL, layout, cluster, 16, TimeKnobs(tp_weight_grad_overlap=False))
    assert unhidden.tp_comm == pytest.approx(m * (4 * L // 2 + 1) * all_reduce + m * alpha)
    slow_links = dataclasses.replace(cluster, intra_node_gbps=1.0)  # partly hidden
    slow = step_time(MODEL, layout, slow_links, 16)
    ring = (s * b * h * 2) / 1e9 + alpha
    hidden = sum(2 * T * h * n / 2 / rate for n in (3 * h, 4 * h))
    logits_weight_grad = 2 * T * h * V / 2 / rate
    exposed = L // 2 * (4 * ring - hidden) + ring - logits_weight_grad + alpha
    assert slow.tp_comm == pytest.approx(m * exposed)
    p = 2
    first_stage = (
        3 * L // 2 * layer / 2 / rate
        + L
        // 2
        * (  # the embedding's all-reduce
            2 * all_reduce + beyond(3 * h) + beyond(4 * h)
        )
        + all_reduce
    )
    assert t.bubble == pytest.approx((p - 1) * first_stage)  # it fills and drains the last
    tiny_logits = dataclasses.replace(MODEL, vocab_size=128)
    even = step_time(tiny_logits, dataclasses.replace(layout, tp=1), cluster, 16)
    share = even.bubble / (even.compute + even.tp_comm + even.bubble)
    assert share == pytest.approx((p - 1) / (m + p - 1), rel=0.02)  # tiny logits: the closed form
    assert t.pp_comm == pytest.approx(2 * (m + p - 1) * ((s * b * h * 2 / 2) / 100e9 + alpha))
    assert t.dp_comm == 0.0
    three_iterations = 3 * (L * layer + 2 * T * h * V) * m  # Megatron's model FLOPs
    assert t.flops == three_iterations
    assert t.tflops_per_gpu == pytest.approx(three_iterations / (t.total * 4 * 1e12))


def test_data_parallel_bytes_by_hand() -> None:
    """DP4 inside a node: all-reduce of fp32 grads, or reduce-scatter fp32 + all-gather bf16."""
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=1)
    cluster = dataclasses.replace(SMALL, nodes=1)
    params = layout_memory(MODEL, layout, 8).parameters
    ddp = step_time(MODEL, layout, cluster, 8).dp_comm
    alpha = 20e-6  # one bucket (under 40M elements): one all-reduce
    assert params < 40_000_000
    assert ddp == pytest.approx(2 * 3 / 4 * params * 4 / 100e9 + alpha)
    zero = step_time(MODEL, dataclasses.replace(layout, sharding="optim"), cluster, 8)
    assert zero.dp_comm == pytest.approx(3 / 4 * params * (4 + 2) / 100e9 + 2 * alpha)
    hidden = step_time(MODEL, layout, cluster, 8, TimeKnobs(dp_overlap=0.75)).dp_comm
    assert hidden == pytest.approx(ddp / 4)
    across = step_time(MODEL, layout, dataclasses.replace(cluster, gpus_per_node=2), 8).dp_comm
    assert across == pytest.approx((ddp - alpha) * 10 + alpha)  # 10x slower InfiniBand


def test_sharded_data_parallel_bytes_by_hand() -> None:
    """DP4 in a node, 8 micro-batches: ZeRO-2 gathers (bf16) and reduce-scatters (fp32) each
    micro-batch, ZeRO-3 gathers twice; one collective per FSDP group (8 layers + the chunk)."""
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=1)
    cluster = dataclasses.replace(SMALL, nodes=1)
    params = layout_memory(MODEL, layout, 32).parameters
    m, groups, alpha = 8, 8 + 1, 20e-6
    gather = 3 / 4 * params * 2 / 100e9 + groups * alpha
    reduce = 3 / 4 * params * 4 / 100e9 + groups * alpha
    zero1 = step_time(MODEL, dataclasses.replace(layout, sharding="optim"), cluster, 32)
    zero2 = step_time(MODEL, dataclasses.replace(layout, sharding="optim_grads"), cluster, 32)
    zero3 = step_time(MODEL, dataclasses.replace(layout, sharding="optim_grads_params"),
                      cluster, 32)  # fmt: skip
    assert zero2.dp_comm == pytest.approx(m * (gather + reduce))
    assert zero3.dp_comm == pytest.approx(m * (2 * gather + reduce))
    assert (zero2.dp_gather, zero3.dp_gather) == pytest.approx((m * gather, 2 * m * gather))
    assert zero1.dp_gather == pytest.approx(3 / 4 * params * 2 / 100e9 + alpha)
    assert zero1.dp_comm < zero2.dp_comm < zero3.dp_comm  # the same compute otherwise
    assert zero1.compute == zero3.compute and zero1.tp_comm == zero3.tp_comm
    # Overlap: the gathers behind compute (FSDP2's prefetch), the reduce-scatters behind the
    # backward, never more than a micro-batch's compute per micro-batch.
    hidden = TimeKnobs(dp_overlap=1.0, param_gather_overlap=1.0)
    overlapped = step_time(MODEL, dataclasses.replace(layout, sharding="optim_grads_params"),
                           cluster, 32, hidden)  # fmt: skip
    per_microbatch = 2 * gather + reduce - zero3.compute / m
    assert overlapped.dp_comm == pytest.approx(m * max(0.0, per_microbatch))
    half = TimeKnobs(param_gather_overlap=0.5)
    slow = dataclasses.replace(cluster, peak_tflops=0.01)  # compute hides all it may
    halved = step_time(MODEL, dataclasses.replace(layout, sharding="optim_grads"), slow, 32, half)
    assert halved.dp_comm == pytest.approx(m * (gather / 2 + reduce))
    # Under a pipeline the per-micro-batch collectives lengthen the bubble too.
    piped = Layout(tp=1, pp=2, dp=4, micro_batch=1, sharding="optim")
    bubble1 = step_time(MODEL, piped, SMALL, 32).bubble
    bubble3 = step_time(MODEL, dataclasses.replace(piped, sharding="optim_grads_params"),
                        SMALL, 32).bubble  # fmt: skip
    assert bubble3 > bubble1


def test_fsdp_buffer_copies_by_hand() -> None:
    """With the device's memory bandwidth given, ZeRO-3 also pays FSDP2's copies per
    micro-batch (two gathers' shard in and whole out in bf16, the fp32 reduce-scatter's whole in
    and shard out, each byte read and written), which no overlap hides."""
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=1, sharding="optim_grads_params")
    cluster = dataclasses.replace(SMALL, nodes=1)
    params = layout_memory(MODEL, layout, 32).parameters
    copies = 2 * (2 * params * 2 * (1 + 1 / 4) + params * 4 * (1 + 1 / 4)) / 50e9
    plain = step_time(MODEL, layout, cluster, 32)
    copied = step_time(MODEL, layout, dataclasses.replace(cluster, memory_gbps=50.0), 32)
    assert copied.dp_comm - plain.dp_comm == pytest.approx(8 * copies)
    hidden = TimeKnobs(dp_overlap=1.0, param_gather_overlap=1.0)
    slow = dataclasses.replace(cluster, peak_tflops=0.01)  # compute could hide everything
    no_copies = step_time(MODEL, layout, slow, 32, hidden)
    with_copies = step_time(MODEL, layout, dataclasses.replace(slow, memory_gbps=50.0), 32, hidden)
    assert no_copies.dp_comm == pytest.approx(0.0)
    assert with_copies.dp_comm == pytest.approx(8 * copies)
    assert SMALL.memory_gbps is None  # the other by-hand cases leave the copies out


def test_slow_sharded_collectives_by_hand() -> None:
    """A cluster whose reduce-scatters and all-gathers reach half the ring bandwidth (gloo's
    reach about 0.4) doubles their bytes' time, not their latency; all-reduces are unchanged."""
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=1, sharding="optim_grads_params")
    cluster = dataclasses.replace(SMALL, nodes=1)
    params = layout_memory(MODEL, layout, 32).parameters
    transfer = 8 * 3 / 4 * params * (2 * 2 + 4) / 100e9  # 8 micro-batches, 2 gathers + 1 RS
    full = step_time(MODEL, layout, cluster, 32)
    half = step_time(MODEL, layout, dataclasses.replace(cluster, shard_collective_efficiency=0.5),
                     32)  # fmt: skip
    assert half.dp_comm - full.dp_comm == pytest.approx(transfer)
    plain = dataclasses.replace(layout, sharding="no_shard")
    assert (
        step_time(MODEL, plain, cluster, 32).dp_comm
        == step_time(
            MODEL, plain, dataclasses.replace(cluster, shard_collective_efficiency=0.5), 32
        ).dp_comm
    )


def _verdict(result) -> str:
    return next(line for line in format_plan(result).splitlines() if "sharded DP vs" in line)


PURE_DP = PlanOptions(micro_batches=(1,), recompute=("full",), schedules=("1f1b",))


def test_zero3_fits_what_zero1_does_not_at_the_same_dp() -> None:
    """ZeRO-3 shards the parameters and gradients too: at DP8 its model state and its total
    are below ZeRO-1's, so a GPU between the two holds ZeRO-3 and not ZeRO-1."""
    zero1 = layout_memory(MODEL, Layout(1, 1, 8, recompute="full", sharding="optim"), 16)
    zero3 = layout_memory(MODEL, Layout(1, 1, 8, recompute="full",
                                        sharding="optim_grads_params"), 16)  # fmt: skip
    state = lambda x: x.params + x.grads + x.optimizer  # noqa: E731
    assert state(zero3) < state(zero1) and zero3.total < zero1.total
    assert zero3.gathered > 0  # the layers it holds gathered while the step runs
    gpu = dataclasses.replace(SMALL, memory_bytes=(zero1.total + zero3.total) / 2)
    result = plan(MODEL, gpu, 16, dataclasses.replace(PURE_DP, memory_fraction=1.0))
    ranked = {e.layout.describe() for e in result.ranked}
    assert "TP1 PP1 DP8 mb1 full ZeRO-3 1f1b" in ranked
    over = {r.what for r in result.rejected if r.category == "memory"}
    assert {"TP1 PP1 DP8 mb1 full dist-opt 1f1b", "TP1 PP1 DP8 mb1 full 1f1b"} <= over
    assert "at DP8 fits (#" in _verdict(result)


def test_with_memory_to_spare_zero1_ranks_above_zero3() -> None:
    """ZeRO-3's extra all-gathers cost time and buy only memory: with memory to spare every
    ZeRO-3 layout is slower than the same layout under ZeRO-1, and the plan says so."""
    roomy = dataclasses.replace(SMALL, memory_bytes=1e6 * GIB)
    result = plan(MODEL, roomy, 16, PURE_DP)
    by_layout = {e.layout: e.time.total for e in result.ranked}
    zero3 = [x for x in by_layout if x.sharding == "optim_grads_params"]
    assert zero3
    for layout in zero3:
        assert by_layout[dataclasses.replace(layout, sharding="optim")] < by_layout[layout]
    first1 = result.position(lambda x: x.sharding == "optim")
    first3 = result.position(lambda x: x.sharding == "optim_grads_params")
    assert first1 and first3 and first1[0] < first3[0]
    line = _verdict(result)
    assert "slower than the best TP x PP layout (#" in line and "DP comm +" in line, line


def test_the_verdict_when_sharding_wins_and_when_it_does_not_fit() -> None:
    """Slow matmuls hide every collective (overlap on): ZeRO-3 at DP8 has no bubble and no TP
    comm, so it beats every TP x PP layout. A long sequence whose activations only TP x PP
    split: no ZeRO-2/3 layout fits, and the line says which came closest."""
    hidden = TimeKnobs(dp_overlap=1.0, param_gather_overlap=1.0)
    slow = dataclasses.replace(SMALL, peak_tflops=0.5)
    line = _verdict(plan(MODEL, slow, 16, PlanOptions(micro_batches=(1,), knobs=hidden)))
    assert "at DP8 fits (#" in line and "faster than the best TP x PP layout (#" in line, line
    long = dataclasses.replace(MODEL, seq_length=2048)
    roomy = plan(long, dataclasses.replace(SMALL, memory_bytes=1e6 * GIB), 16, PURE_DP)
    smallest = lambda match: min(e.memory.total for e in roomy.ranked if match(e.layout))  # noqa: E731
    sharded = smallest(lambda x: x.tp == x.pp == 1 and x.fsdp)
    split = smallest(lambda x: x.tp * x.pp > 1 and not x.fsdp)
    assert split < sharded
    gpu = dataclasses.replace(SMALL, memory_bytes=(split + sharded) / 2)
    line = _verdict(plan(long, gpu, 16, dataclasses.replace(PURE_DP, memory_fraction=1.0)))
    assert "no ZeRO-2/3 layout at DP8 fits: the smallest (TP1 PP1 DP8" in line, line
    assert "GiB usable" in line and "the best TP x PP layout (#" in line and line.endswith("does")


def test_sharded_gradients_with_a_zero_bubble_schedule_keep_the_stage_gathered() -> None:
    """ZeRO-3 under a zero-bubble schedule reduces after the step's last W, so its memory
    counts every layer gathered, as ZeRO-2 does (the stage estimate, tests/test_stage_memory)."""
    result = plan(MODEL, SMALL, 16, PlanOptions(micro_batches=(1,), recompute=("none",)))
    zb = {
        (e.layout.tp, e.layout.pp, e.layout.dp): e
        for e in result.ranked
        if e.layout.sharding == "optim_grads_params" and e.layout.schedule == "zero-bubble-h1"
    }
    plain = {
        (e.layout.tp, e.layout.pp, e.layout.dp): e
        for e in result.ranked
        if e.layout.sharding == "optim_grads_params" and e.layout.schedule == "1f1b"
    }
    common = [k for k in zb if k in plain and k[1] > 1]
    assert common
    assert all(zb[k].memory.gathered > plain[k].memory.gathered for k in common)  # fmt: skip
    assert {e.layout.sharding for e in result.ranked} == {
        "no_shard", "optim", "optim_grads", "optim_grads_params"}  # fmt: skip
    with pytest.raises(ValueError, match="sharding"):
        Layout(1, 1, 2, 1, 1, "none", True)  # the old positional distributed_optimizer


def _reasons(result) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in result.rejected:
        out.setdefault(r.category, []).append(f"{r.what}: {r.reason}")
    return out


def test_infeasible_layouts_are_rejected_with_the_reason() -> None:
    model = dataclasses.replace(MODEL, num_attention_heads=4, num_layers=6)
    result = plan(model, SMALL, 12, PlanOptions(micro_batches=(1, 8)))
    reasons = _reasons(result)
    assert "TP8: heads (4) not divisible by TP (8)" in reasons["heads % TP"]
    assert "TP1 PP4 1f1b: layers (6) not divisible by PP x VP (4 x 1)" in reasons["layers % PPxVP"]
    assert any("TP1 PP2 DP4 mb8" in r and "(12) not divisible by micro-batch x DP (8 x 4)" in r
               for r in reasons["batch % mb x DP"])  # fmt: skip
    assert any("multiple of --pipeline-model-parallel-size" in r for r in reasons["schedule"])
    for entry in result.ranked:
        layout = entry.layout
        assert model.num_attention_heads % layout.tp == 0
        assert model.num_layers % (layout.pp * layout.vp) == 0
        assert 12 % (layout.micro_batch * layout.dp) == 0
    wide = dataclasses.replace(SMALL, gpus_per_node=2)
    across = {r.what for r in plan(model, wide, 12).rejected if r.category == "TP across nodes"}
    assert "TP4" in across
    crossing = plan(model, wide, 12, PlanOptions(allow_cross_node_tp=True))
    assert any(e.layout.tp == 4 for e in crossing.ranked)
    six = dataclasses.replace(SMALL, gpus_per_node=8, nodes=3)  # TP3 of 8: groups straddle nodes
    twelve = ModelConfig(num_layers=6, hidden_size=384, num_attention_heads=12, vocab_size=1000,
                         seq_length=128)  # fmt: skip
    rejected = plan(twelve, six, 24).rejected
    assert "TP3" in {r.what for r in rejected if r.category == "TP across nodes"}


def test_memory_over_the_gpu_is_rejected() -> None:
    small_gpu = dataclasses.replace(SMALL, memory_bytes=0.05 * GIB)
    result = plan(MODEL, small_gpu, 16, PlanOptions(memory_fraction=1.0))
    assert result.ranked, "some layout fits 51 MiB"
    assert all(e.memory.total <= 0.05 * GIB for e in result.ranked)
    over = [r for r in result.rejected if r.category == "memory"]
    assert over and all("GiB usable" in r.reason for r in over)
    fits = {e.layout for e in plan(MODEL, SMALL, 16).ranked}
    assert {e.layout for e in result.ranked} < fits


def test_better_hardware_never_makes_the_choice_slower() -> None:
    base = plan(MODEL, SMALL, 16).ranked[0].time.total
    for better in (
        dataclasses.replace(SMALL, memory_bytes=64 * GIB),
        dataclasses.replace(SMALL, inter_node_gbps=50.0),
        dataclasses.replace(SMALL, intra_node_gbps=400.0, inter_node_gbps=40.0),
        dataclasses.replace(SMALL, collective_latency_us=0.0),
    ):
        assert plan(MODEL, better, 16).ranked[0].time.total <= base
    tight = dataclasses.replace(SMALL, memory_bytes=0.05 * GIB)
    assert plan(MODEL, tight, 16).ranked[0].time.total >= base


@pytest.mark.skipif("zero-bubble-h1" not in SCHEDULE_KINDS, reason="no zero-bubble-h1 yet")
def test_zero_bubble_is_searched_and_beats_1f1b_on_bubble() -> None:
    result = plan(MODEL, SMALL, 16, PlanOptions(micro_batches=(1,), recompute=("none",)))
    zb = result.position(lambda x: x.schedule == "zero-bubble-h1" and x.pp == 4)
    ofb = result.position(lambda x: x.schedule == "1f1b" and x.pp == 4)
    assert zb and ofb
    assert zb[1].time.bubble_fraction < ofb[1].time.bubble_fraction


def test_cli_prints_the_ranking_and_why(capsys) -> None:
    code = plan_tool.main(["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads",
                           "8", "--seq-length", "128", "--vocab-size", "1000",
                           "--global-batch-size", "16", "--gpus-per-node", "4", "--top", "3",
                           "--show-rejected", "--explain"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "rank | layout" in out and "   1 | TP" in out and "   3 | TP" in out
    assert "why #1" in out and "compute" in out and "DP comm" in out and "optimizer" in out
    assert out.count("       step ") == 3  # --explain: the terms under each listed layout
    assert "rejected:\n" in out and "GiB usable" not in out  # the tiny model fits 80 GiB anyhow
    verdict = [line for line in out.splitlines() if line.startswith("sharded DP vs TP x PP: ")]
    assert len(verdict) == 1 and "at DP4 fits (#" in verdict[0], verdict


def test_cli_sharding_flags(capsys) -> None:
    """--sharding picks strategies; --distributed-optimizer keeps its old meaning (no ZeRO-2/3)."""
    base = ["--model-preset", "gpt3-125m", "--global-batch-size", "16", "--gpus-per-node", "4",
            "--micro-batch-sizes", "1", "--recompute", "full", "--schedules", "1f1b",
            "--top", "200"]  # fmt: skip
    assert plan_tool.main([*base, "--sharding", "optim_grads_params"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " | TP" in line and " DP1 " not in line]
    assert rows and all("ZeRO-3" in row for row in rows)
    assert plan_tool.main([*base, "--distributed-optimizer", "on"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " | TP" in line]
    assert any("dist-opt" in row for row in rows) and not any("ZeRO-" in row for row in rows)
    assert "sharded DP vs TP x PP: ZeRO-2/3 not searched (--sharding)" in out


def _tp2_step_seconds(capsys, *extra: str) -> tuple[float, str]:
    """The CLI's estimated step of TP2 PP1 DP1 (a 1.3B model on 2 GPUs), and its output."""
    plan_tool.main(["--model-preset", "gpt3-1.3b", "--global-batch-size", "16",
                    "--gpus-per-node", "2", "--nodes", "1", "--micro-batch-sizes", "1",
                    "--recompute", "none", "--schedules", "1f1b", "--top", "50",
                    *extra])  # fmt: skip
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "| TP2 PP1 DP1 mb1 none" in line)
    return float(row.split("|")[3]), out


def test_cli_latency_and_async_all_reduce_flags_change_the_estimate(capsys) -> None:
    base, out = _tp2_step_seconds(capsys)
    assert "30 us per collective" in out  # the preset's
    unhidden, _ = _tp2_step_seconds(capsys, "--no-async-tensor-model-parallel-allreduce")
    assert unhidden > base  # the backward all-reduces no longer hide under the dW matmuls
    slower, out = _tp2_step_seconds(
        capsys, "--collective-latency-us", "1000", "--no-async-tensor-model-parallel-allreduce"
    )
    assert "1000 us per collective" in out
    # 16 micro-batches x (24 layers x 4 + embedding + output layer + cross-entropy)
    assert slower - unhidden == pytest.approx(16 * (24 * 4 + 3) * (1000 - 30) * 1e-6, abs=2e-3)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--model-preset", "gpt3-125m", "--global-batch-size", "-8"], "--global-batch-size"),
        (
            ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--hidden-size", "0"],
            "--hidden-size",
        ),
        (["--model-preset", "nope", "--global-batch-size", "8"], "--model-preset"),
        (
            ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--cluster", "dgx-z"],
            "--cluster",
        ),
        (["--hidden-size", "64", "--global-batch-size", "8"], "--num-layers"),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq", "32"],
            "--global-batch-size is required (a --model-preset brings its paper's)",
        ),
        (
            [
                "--model-preset",
                "gpt3-125m",
                "--global-batch-size",
                "8",
                "--collective-latency-us",
                "-1",
            ],
            "--collective-latency-us",
        ),  # fmt: skip
        (
            ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--recompute", "half"],
            "--recompute",
        ),
        (
            ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--sharding", "zero3"],
            "--sharding",
        ),
        (
            [
                "--model-preset",
                "gpt3-125m",
                "--global-batch-size",
                "8",
                "--sharding",
                "optim",
                "--distributed-optimizer",
                "on",
            ],
            "--sharding and --distributed-optimizer",
        ),  # fmt: skip
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        plan_tool.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and flag in err, err


def test_a_model_preset_brings_its_papers_global_batch(capsys) -> None:
    assert plan_tool.main(["--model-preset", "gpt3-125m", "--nodes", "1", "--top", "1"]) == 0
    assert "global batch 256" in capsys.readouterr().out.splitlines()[0]  # GPT-3's 0.5M tokens


def test_presets_are_the_published_layouts() -> None:
    a100 = PRESETS["dgx-a100"]
    assert (a100.peak_tflops, a100.gpus_per_node, a100.intra_node_gbps, a100.inter_node_gbps) == (
        312.0, 8, 300.0, 25.0)  # fmt: skip
    h100 = PRESETS["dgx-h100"]
    assert (h100.peak_tflops, h100.intra_node_gbps, h100.inter_node_gbps) == (989.4, 450.0, 50.0)
