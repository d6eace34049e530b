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
    Layout(tp=2, pp=2, dp=2, micro_batch=1, recompute="full", distributed_optimizer=True),
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
    assert (got.params, got.grads, got.optimizer, got.activations) == (
        largest.parameter_bytes, largest.gradient_bytes, largest.optimizer_bytes,
        largest.activation_bytes)  # fmt: skip


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
    zero = layout_memory(MODEL, dataclasses.replace(layout, distributed_optimizer=True), 32)
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
    zero = step_time(MODEL, dataclasses.replace(layout, distributed_optimizer=True), cluster, 8)
    assert zero.dp_comm == pytest.approx(3 / 4 * params * (4 + 2) / 100e9 + 2 * alpha)
    hidden = step_time(MODEL, layout, cluster, 8, TimeKnobs(dp_overlap=0.75)).dp_comm
    assert hidden == pytest.approx(ddp / 4)
    across = step_time(MODEL, layout, dataclasses.replace(cluster, gpus_per_node=2), 8).dp_comm
    assert across == pytest.approx((ddp - alpha) * 10 + alpha)  # 10x slower InfiniBand


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
