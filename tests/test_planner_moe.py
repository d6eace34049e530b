"""Mixtures of experts in the memory model and the planner, each term written out by hand:
parameters per rank at E / EP experts, expert optimizer state over the expert-DP ranks, the
memory partition counting each MoE layer's experts, FLOPs of the active parameters, the
expert-parallel token exchange (alltoall, allgather), the experts' TP all-reduces, expert
gradients reduced over expert-DP; rejections with the reason; a model that needs EP to fit."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megapipe.config import ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig, RecomputeConfig
from megapipe.model.activation_memory import layer_activation_bytes
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.stage_memory import MemoryModel, recompute_ladder
from megapipe.pipeline.stage_parameters import (
    active_parameters,
    layer_parameters,
    stage_expert_parameters,
    stage_parameters,
)
from megapipe.planning.cluster import GIB, Cluster
from megapipe.planning.layout import Layout
from megapipe.planning.memory import layout_memory
from megapipe.planning.search import PlanOptions, plan
from megapipe.planning.time_model import step_time
from megapipe.training.flops import flops_per_iteration

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import plan as plan_tool  # noqa: E402

H, F, E, K, V = 256, 512, 8, 2, 1024
MOE_MODEL = ModelConfig(
    num_layers=4, hidden_size=H, num_attention_heads=8, vocab_size=V, seq_length=128,
    ffn_hidden_size=F, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
    moe=MoEConfig(num_experts=E, moe_router_topk=K),
)  # fmt: skip
CLUSTER = Cluster("test", gpus_per_node=8, nodes=1, memory_bytes=80 * GIB, peak_tflops=100.0,
                  intra_node_gbps=100.0, inter_node_gbps=10.0, matmul_efficiency=0.5,
                  collective_latency_us=20.0)  # fmt: skip
ATTENTION = 4 * H * H + 2 * 2 * H  # QKV and projection, two LayerNorms (weights and biases)
EXPERT = 2 * H * F  # fc1 and fc2, GeLU, no biases


def test_parameters_per_rank_count_experts_at_e_over_ep() -> None:
    """An MoE layer: attention, router (E h) and E / EP experts; TP splits the experts."""
    assert layer_parameters(MOE_MODEL, 1) == ATTENTION + E * H + E * EXPERT
    assert layer_parameters(MOE_MODEL, 1, 0, 4) == ATTENTION + E * H + E // 4 * EXPERT
    attention_tp2 = 4 * H * H // 2 + 2 * 2 * H
    assert layer_parameters(MOE_MODEL, 2, 0, 2) == attention_tp2 + E * H + E // 2 * EXPERT // 2
    assert stage_expert_parameters(MOE_MODEL, range(1, 3), 1, 8) == 2 * EXPERT
    embedding = V * H + 128 * H  # words and learned positions; the head is tied
    final_norm = 2 * H
    assert stage_parameters(MOE_MODEL, 4, True, True, 1, 2) == (
        4 * (ATTENTION + E * H + E // 2 * EXPERT) + embedding + final_norm)  # fmt: skip
    # active: every dense parameter, the router, and top-2 of the 8 experts
    active = 4 * (ATTENTION + E * H + K * EXPERT) + embedding + final_norm
    assert active_parameters(MOE_MODEL) == active


def test_expert_state_shards_over_expert_dp() -> None:
    """DP8 EP4, bf16, distributed optimizer: dense parameters' 12 optimizer bytes shard over
    8 ranks, expert parameters' over the 2 expert-DP ranks; parameters (2) and fp32
    gradients (4) are held whole by either."""
    parallel = ParallelConfig(expert_model_parallel_size=4)
    model = MemoryModel(MOE_MODEL, parallel, OptimizerConfig(bf16=True,
                        use_distributed_optimizer=True), RecomputeConfig(), 1, 1, 8)  # fmt: skip
    assert (model.shard_ranks, model.expert_shard_ranks) == (8, 2)
    stage = model.stage(0, [4], 1)
    experts = 4 * (E // 4) * EXPERT
    dense = stage.parameters - experts
    assert stage.expert_parameters == experts
    assert stage.parameter_bytes == 2 * (dense + experts)
    assert stage.gradient_bytes == 4 * (dense + experts)
    assert stage.optimizer_bytes == 12 * dense / 8 + 12 * experts / 2
    # EP1 at DP8: every expert, its state over all 8 ranks
    one = MemoryModel(MOE_MODEL, ParallelConfig(), model.optimizer, RecomputeConfig(), 1, 1, 8)
    assert one.stage(0, [4], 1).expert_parameters == 4 * E * EXPERT
    assert one.stage(0, [4], 1).optimizer_bytes == 12 * (dense + 4 * E * EXPERT) / 8


def test_stage_activations_sum_moe_and_dense_layers() -> None:
    """--moe-layer-freq 2: layers 0 and 2 MoE, 1 and 3 dense; a stage's activations are the
    sum of its layers' own formulas (a range of global layers, or a count from layer 0)."""
    alternating = dataclasses.replace(
        MOE_MODEL, moe=dataclasses.replace(MOE_MODEL.moe, moe_layer_freq=2)
    )
    model = MemoryModel(alternating, ParallelConfig(pipeline_model_parallel_size=2),
                        OptimizerConfig(), RecomputeConfig(), 2, 4, 1)  # fmt: skip
    moe, dense = (layer_activation_bytes(alternating, 2, layer=i) for i in (0, 1))
    assert moe > dense
    first = model.stage(0, [range(0, 1)], 1)  # layer 0 alone: an MoE layer
    second = model.stage(0, [range(1, 2)], 1)  # layer 1 alone: dense
    assert first.activation_bytes - second.activation_bytes == moe - dense
    assert model.stage(0, [3], 1).activation_bytes == model.stage(0, [range(3)], 1).activation_bytes


def test_memory_partition_counts_the_experts_of_each_layer() -> None:
    """MoE on layers 0-3 of 8 (heavy: 8 experts each), dense on 4-7: the memory partition
    gives the first stage fewer layers than the count-blind uniform split, and the stages it
    chooses are within what any split of the real layers can reach."""
    model = dataclasses.replace(MOE_MODEL, num_layers=8, moe=dataclasses.replace(
        MOE_MODEL.moe, moe_layer_freq=(1, 1, 1, 1, 0, 0, 0, 0)))  # fmt: skip
    estimate = MemoryModel(model, ParallelConfig(pipeline_model_parallel_size=2),
                           OptimizerConfig(), RecomputeConfig(), 1, 8, 1)  # fmt: skip
    chosen = partition_layers(model, 2, method="memory", stage_bytes=estimate.stage_bytes())
    counts = [len(chunks[0]) for chunks in chosen.layers]
    assert counts[0] < counts[1]
    cost = estimate.stage_bytes()
    best = min(abs(cost(0, range(0, n)) - cost(1, range(n, 8))) for n in range(1, 8))
    got = estimate.stages(chosen)
    assert abs(got[0].total_bytes - got[1].total_bytes) == pytest.approx(best)


def test_moe_stages_recompute_only_what_moe_layers_allow() -> None:
    ladder = recompute_ladder(4, moe=True)
    assert [r.describe() for r in ladder] == [r.describe() for r in recompute_ladder(4)[:2]]


def test_flops_count_the_router_top_k_experts_and_the_shared_expert() -> None:
    """Megatron's count per layer (3 passes), with the MoE MLP's active matmuls only."""
    shared = dataclasses.replace(MOE_MODEL, moe=dataclasses.replace(
        MOE_MODEL.moe, moe_shared_expert_intermediate_size=128))  # fmt: skip
    b, s, L = 4, 128, 4
    T = b * s
    attention = 2 * T * H * 3 * H + 2 * b * s * s * H + 2 * T * H * H
    router, experts, shared_mlp = 2 * T * H * E, K * 2 * T * H * F * 2, 2 * T * H * 128 * 2
    logits = 2 * T * H * V
    got = flops_per_iteration(shared, b, padded_vocab_size=V)
    assert got == 3 * (L * (attention + router + experts + shared_mlp) + logits)


def test_expert_parallel_exchange_by_hand() -> None:
    """TP1 PP1 DP8 EP4 in one node, micro-batch 2: per MoE layer and micro-batch, 4
    all-to-alls of (EP-1)/EP of the rank's T k rows (bf16) and the counts' all-to-all
    (latency); allgather: 2 gathers/reduce-scatters of (EP-1) T h each way and the routing."""
    layout = Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=4)
    t = step_time(MOE_MODEL, layout, CLUSTER, 64)
    m, T, alpha, gbps = 4, 2 * 128, 20e-6, 100e9
    moved = 3 / 4 * T * K * H * 2
    per_layer = 4 * (moved / gbps + alpha) + alpha
    assert t.ep_comm == pytest.approx(m * 4 * per_layer)
    assert t.terms()["EP comm"] == t.ep_comm
    gathered = step_time(MOE_MODEL, dataclasses.replace(layout, moe_dispatcher="allgather"),
                         CLUSTER, 64)  # fmt: skip
    rows, routing = 3 * T * H * 2, 3 * T * E
    forward = (2 * rows + 5 * routing) / gbps + 4 * alpha
    backward = (2 * rows + 4 * routing) / gbps + 3 * alpha
    assert gathered.ep_comm == pytest.approx(m * 4 * (forward + backward))
    # across nodes (TP x EP = 16 > 8 GPUs): InfiniBand
    two_nodes = dataclasses.replace(CLUSTER, nodes=2)
    wide = step_time(MOE_MODEL, Layout(tp=2, pp=1, dp=8, micro_batch=2, ep=8), two_nodes, 64)
    moved = 7 / 8 * T * K * H * 2
    assert wide.ep_comm == pytest.approx(m * 4 * (4 * (moved / 10e9 + alpha) + alpha))
    assert step_time(MOE_MODEL, dataclasses.replace(layout, ep=1), CLUSTER, 64).ep_comm == 0


def test_expert_gradients_reduce_over_expert_dp_by_hand() -> None:
    """DP8 EP4, no sharding: dense gradients all-reduced over 8 ranks, expert gradients over
    the 2 expert-DP ranks (fp32, ring, one bucket each)."""
    layout = Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=4)
    t = step_time(MOE_MODEL, layout, CLUSTER, 64)
    params = stage_parameters(MOE_MODEL, 4, True, True, 1, 4)
    experts = 4 * (E // 4) * EXPERT
    alpha = 20e-6
    dense = 2 * 7 / 8 * (params - experts) * 4 / 100e9 + alpha
    expert = 2 * 1 / 2 * experts * 4 / 100e9 + alpha
    assert t.dp_comm == pytest.approx(dense + expert)


def test_experts_tp_all_reduces_by_hand() -> None:
    """TP2 EP1 DP4: an MoE layer's forward all-reduces are the attention's (T h) and the
    experts' output rows (T k h); backward, QKV's and the experts' input rows, each beyond
    its weight-gradient GEMM (none hides here: slow links)."""
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=2)
    slow = dataclasses.replace(CLUSTER, intra_node_gbps=0.01)
    t = step_time(MOE_MODEL, layout, slow, 32)
    m, T, alpha, rate = 4, 2 * 128, 20e-6, 100e12 * 0.5

    def reduce(nbytes: float) -> float:
        return 2 * 1 / 2 * nbytes / 0.01e9 + alpha

    tokens, rows = T * H * 2, T * K * H * 2
    qkv, experts = 2 * T * H * 3 * H / 2 / rate, 2 * T * K * H * F / 2 / rate
    per_layer = reduce(tokens) + reduce(rows) + reduce(tokens) - qkv + reduce(rows) - experts
    embedding, output = reduce(tokens), reduce(tokens) - 2 * T * H * V / 2 / rate + alpha
    assert t.tp_comm == pytest.approx(m * (4 * per_layer + embedding + output))


def test_compute_counts_active_parameters_at_any_ep() -> None:
    """Balanced routing: every EP rank's experts compute T k rows, so compute is EP-free."""
    one = step_time(MOE_MODEL, Layout(tp=1, pp=1, dp=8, micro_batch=2), CLUSTER, 64)
    four = step_time(MOE_MODEL, Layout(tp=1, pp=1, dp=8, micro_batch=2, ep=4), CLUSTER, 64)
    assert one.compute == four.compute
    assert one.flops == flops_per_iteration(MOE_MODEL, 64, padded_vocab_size=V)


def test_rejections_name_experts_and_dp_x_cp() -> None:
    """6 experts (EP 4 does not divide them), DP x CP of 2 at PP4 (EP 8 does not fit it),
    and no full recomputation for MoE layers."""
    six = dataclasses.replace(MOE_MODEL, moe=dataclasses.replace(MOE_MODEL.moe, num_experts=6))
    options = PlanOptions(micro_batches=(1,), expert_parallel=(1, 2, 4), sharding=("no_shard",))
    result = plan(six, CLUSTER, 16, options)
    reasons = {r.category: r.reason for r in result.rejected}
    assert reasons["experts % EP"] == "experts (6) not divisible by EP (4)"
    assert reasons["MoE recompute"].startswith("MoE layers refuse full recomputation")
    assert all(e.layout.recompute != "full" for e in result.ranked)
    options = dataclasses.replace(options, expert_parallel=(8,))
    result = plan(MOE_MODEL, CLUSTER, 16, options)
    reasons = [r.reason for r in result.rejected if r.category == "DP x CP % EP"]
    assert "DP x CP (2 x 1) not divisible by EP (8)" in reasons
    assert all(e.layout.ep == 8 and e.layout.dp * e.layout.cp % 8 == 0 for e in result.ranked)


def test_what_start_up_refuses_is_rejected() -> None:
    """ZeRO-2/3 with EP = DP x CP (nothing to shard experts over) and a capacity factor
    under CP."""
    options = PlanOptions(micro_batches=(1,), expert_parallel=(1, 2), recompute=("none",),
                          sharding=("optim", "optim_grads"), max_vp=1)  # fmt: skip
    result = plan(MOE_MODEL, CLUSTER, 16, options)
    assert any(r.category == "ZeRO-2/3 with EP" for r in result.rejected)
    whole = {(e.layout.ep == e.layout.dp * e.layout.cp, e.layout.fsdp) for e in result.ranked}
    assert (True, True) not in whole and {(True, False), (False, True)} <= whole
    capped = dataclasses.replace(MOE_MODEL, moe=dataclasses.replace(
        MOE_MODEL.moe, moe_expert_capacity_factor=1.0))  # fmt: skip
    options = dataclasses.replace(options, context_parallel=(1, 2), sharding=("optim",))
    result = plan(capped, CLUSTER, 16, options)
    assert any(r.category == "capacity with CP" and r.what == "TP1 CP2" for r in result.rejected)
    assert all(e.layout.cp == 1 for e in result.ranked)


def test_a_large_expert_model_needs_expert_parallelism_to_fit() -> None:
    """64 experts of ffn 4096 on 2 layers of 2 heads (1.07B expert parameters) on one node of
    8 GPUs of 3 GiB, with the distributed optimizer: TP x PP is at most 2 x 2 here, so without
    EP a rank holds a quarter of the experts at 2 + 4 + 12 / 2 bytes each (3.2 GB, over the
    2.9 GB usable); EP shards them further, and the planner picks it."""
    big = ModelConfig(
        num_layers=2,
        hidden_size=1024,
        num_attention_heads=2,
        vocab_size=V,
        seq_length=128,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        moe=MoEConfig(num_experts=64, moe_ffn_hidden_size=4096),
    )
    cluster = dataclasses.replace(CLUSTER, memory_bytes=3 * GIB)
    options = PlanOptions(micro_batches=(1,), max_vp=1, sharding=("no_shard", "optim"))
    result = plan(big, cluster, 32, options)
    assert result.ranked and all(e.layout.ep > 1 for e in result.ranked)
    over = [r.layout for r in result.rejected if r.category == "memory"]
    assert any(x.ep == 1 and x.tp * x.pp == 4 and x.sharding == "optim" for x in over)
    best = result.ranked[0]
    local = 2 * 64 // best.layout.ep * 2 * 1024 * 4096 // (best.layout.tp * best.layout.pp)
    assert best.memory.expert_parameters == local
    assert layout_memory(big, best.layout, 32).total == best.memory.total


def test_cli_moe_flags_and_a_mixtral_preset(capsys) -> None:
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size", "16",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
            "--expert-model-parallel-sizes", "2,4", "--moe-dispatchers", "allgather",
            "--gpus-per-node", "8", "--top", "3"]  # fmt: skip
    assert plan_tool.main(argv) == 0
    out = capsys.readouterr().out
    assert "8 experts (ffn 512) top-2 on 4 layers" in out and "active per token" in out
    table = out.split("rank |")[1].split("why #1")[0]
    assert table.count(" (allgather) ") == 3 and "EP1" not in table
    assert "(TP, CP, EP, PP)" in out
    assert plan_tool.main(["--model-preset", "mixtral-8x7b", "--global-batch-size", "256",
                           "--cluster", "dgx-h100", "--nodes", "4", "--top", "3",
                           "--sharding", "optim", "--micro-batch-sizes", "1",
                           "--schedules", "1f1b", "--recompute", "none"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "46.70B parameters (12.88B active per token)" in out
    assert "(8 query groups), ffn 14336 SwiGLU, 8 experts (ffn 14336) top-2 on 32 layers" in out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--moe-router-topk", "2"], "--moe-router-topk needs --num-experts"),
        (["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk (8) is above"),
        (["--expert-model-parallel-sizes", "2"], "--expert-model-parallel-sizes needs"),
        (["--num-experts", "4", "--moe-dispatchers", "flex"], "--moe-dispatchers: 'flex'"),
    ],
)
def test_cli_bad_moe_input_exits_2_with_one_line(argv, flag, capsys) -> None:
    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size", "16"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        plan_tool.main(base + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err
