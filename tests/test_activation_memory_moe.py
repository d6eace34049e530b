"""Saved activation bytes of a transformer layer with a mixture of experts, counted with
saved_tensors_hooks, equal megapipe/model/activation_memory.py's formula (its MoE terms in
activation_memory_moe.py) byte for byte: routing variants, the losses, capacity (both
policies, padded), SwiGLU and squared ReLU, biases, the grouped GEMM, a shared expert, bf16,
at 1 rank and TP2; and the expert-parallel terms as modelled (balanced routing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.config import ModelConfig, MoEConfig
from megapipe.model.activation_memory import SavedTensorPeak, layer_activation_bytes
from megapipe.model.activation_memory_moe import expert_rows, moe_activation_bytes
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

S, B, H, A = 16, 2, 32, 4
BASE = ModelConfig(
    num_layers=2, hidden_size=H, num_attention_heads=A, vocab_size=64, seq_length=S,
    max_position_embeddings=S, attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
)  # fmt: skip
MOE = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)

# id: (MoEConfig changes, ModelConfig changes)
CASES: dict[str, tuple[dict, dict]] = {
    "softmax top-2": ({}, {}),
    "biases": ({}, {"add_bias_linear": True}),
    "swiglu": ({}, {"swiglu": True}),
    "squared relu": ({}, {"squared_relu": True}),
    "top-1": ({"moe_router_topk": 1}, {}),
    "pre-softmax + aux loss": ({"moe_router_pre_softmax": True, "moe_aux_loss_coeff": 0.01}, {}),
    "sigmoid + scaling + aux loss": (
        {
            "moe_router_score_function": "sigmoid",
            "moe_router_topk_scaling_factor": 2.0,
            "moe_aux_loss_coeff": 0.01,
        },
        {},
    ),  # fmt: skip
    "sigmoid top-1 + expert bias": (
        {
            "moe_router_score_function": "sigmoid",
            "moe_router_topk": 1,
            "moe_router_enable_expert_bias": True,
        },
        {},
    ),  # fmt: skip
    "seq aux loss + z-loss": (
        {
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_aux_loss_coeff": 0.01,
            "moe_z_loss_coeff": 1e-3,
        },
        {},
    ),  # fmt: skip
    "capacity probs": ({"moe_expert_capacity_factor": 0.5}, {}),
    "capacity position": (
        {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"},
        {},
    ),
    "capacity padded": (
        {"moe_expert_capacity_factor": 0.75, "moe_pad_expert_input_to_capacity": True},
        {},
    ),
    "capacity above the tokens": ({"moe_expert_capacity_factor": 4.0}, {}),
    "grouped gemm + biases": ({"moe_grouped_gemm": True}, {"add_bias_linear": True}),
    "grouped gemm swiglu": ({"moe_grouped_gemm": True}, {"swiglu": True}),
    "shared expert": ({"moe_shared_expert_intermediate_size": 16}, {}),
    "shared expert swiglu": ({"moe_shared_expert_intermediate_size": 16}, {"swiglu": True}),
}


def _config(case: str) -> ModelConfig:
    moe, model = CASES[case]
    return dataclasses.replace(BASE, moe=dataclasses.replace(MOE, **moe), **model)


def _measured_and_formula(
    config: ModelConfig,
    state: ParallelState,
    dtype: torch.dtype = torch.float32,
    sp: bool = False,
) -> tuple[int, int]:
    """One MoE layer's saved bytes on this rank (held when its forward returns: two index
    tensors autograd frees at once are not), and the formula at its real row counts: this
    rank's kept assignments and the rows its experts got (they differ under EP)."""
    layer = TransformerLayer(config, state.tp, RNGTracker(1, state.tp_rank), ep=state.ep,
                             sequence_parallel=sp).train().to(dtype)  # fmt: skip
    own, received = [], []
    layer.mlp.router.register_forward_hook(lambda _m, _a, out: own.append(int(out[1].sum())))
    layer.mlp.experts.register_forward_pre_hook(lambda _, a: received.append(a[0].shape[0]))
    torch.manual_seed(4)  # weights that spread tokens over the experts (alike on every rank)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    torch.manual_seed(5 + state.dp_rank)  # EP ranks route different tokens
    local = S // state.tp.size if sp else S
    x = torch.randn(local, B, H, dtype=dtype, requires_grad=True)
    with SavedTensorPeak(layer.parameters()) as counter:
        out = layer(x, None, None, None)
        measured = counter.live  # what autograd still holds for backward
    del out
    dtype_bytes = torch.finfo(dtype).bits // 8
    formula = layer_activation_bytes(
        config, B, state.tp.size, sequence_parallel=sp, dtype_bytes=dtype_bytes,
        ep=state.ep.size, moe_dispatcher=config.moe.moe_token_dispatcher_type,
        moe_rows=own[0], moe_received=received[0],
    )  # fmt: skip
    return measured, formula


EP_CASES = ("softmax top-2", "biases", "swiglu", "capacity probs", "grouped gemm + biases",
            "shared expert")  # fmt: skip


def _table(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Every case on this layout; at TP2 also with sequence parallelism (the MoE layer
    gathers the sequence, so its terms are over whole tokens)."""
    state = ParallelState.build(world, 1) if world > 1 else ParallelState.single()
    table = {case: _measured_and_formula(_config(case), state) for case in CASES}
    if world > 1:
        for case in EP_CASES:
            table[f"SP, {case}"] = _measured_and_formula(_config(case), state, sp=True)
    return table


def _expert_parallel_table(rank: int, world: int) -> dict[str, tuple[int, int]]:
    state = ParallelState.build(1, 1, expert_model_parallel_size=world)
    table = {}
    for case in EP_CASES:
        for dispatcher in ("alltoall", "allgather"):
            moe = dataclasses.replace(_config(case).moe, moe_token_dispatcher_type=dispatcher)
            config = dataclasses.replace(_config(case), moe=moe)
            table[f"{case}, {dispatcher}"] = _measured_and_formula(config, state)
    return table


def test_saved_bytes_under_expert_parallelism_equal_the_formula() -> None:
    """EP2 (two DP ranks splitting 4 experts), each dispatcher: every rank's bytes, at the rows
    it routed and the rows its experts received."""
    for rank, table in enumerate(run_distributed(_expert_parallel_table, 2)):
        for case, (measured, formula) in table.items():
            assert measured == formula, (rank, case, measured, formula)


@pytest.mark.parametrize("case", ["softmax top-2", "shared expert swiglu", "capacity probs"])
def test_saved_bytes_in_bf16_equal_the_formula(case: str) -> None:
    """bf16: the router's fp32 copies of its input and weight, the shared expert's input. The
    MoE terms, as the difference from the same layer with the dense MLP (the dense bf16
    layer's own bytes on this CPU differ from the formula by 256, attention's business)."""
    state, bf16 = ParallelState.single(), torch.bfloat16
    measured, formula = _measured_and_formula(_config(case), state, bf16)
    layer = TransformerLayer(BASE, state.tp, RNGTracker(1, 0), sequence_parallel=False)
    layer = layer.train().to(bf16)
    x = torch.randn(S, B, H, dtype=bf16, requires_grad=True)
    with SavedTensorPeak(layer.parameters()) as counter:
        out = layer(x, None, None, None)
        dense = counter.live
    del out
    assert measured - dense == formula - layer_activation_bytes(BASE, B, dtype_bytes=2)


def test_dense_layers_keep_the_dense_formula() -> None:
    """--moe-layer-freq 2: layer 1 is dense, and its bytes are the dense model's."""
    config = dataclasses.replace(BASE, moe=dataclasses.replace(MOE, moe_layer_freq=2))
    assert layer_activation_bytes(config, B, layer=1) == layer_activation_bytes(BASE, B)
    assert layer_activation_bytes(config, B, layer=0) != layer_activation_bytes(BASE, B)


def test_hand_count_of_one_moe_block() -> None:
    """The terms written out for T = 32 tokens, E 4, top-2, h 32, f 24, fp32, dropless."""
    config = _config("softmax top-2")
    t, k, h, f, n = S * B, 2, H, 24, S * B * 2  # E enters with losses, sigmoid, capacity
    router = t * h * 4 + t * k * 8 + t * k * 4
    dispatch = n * 2 * 8 + n * h * 4
    experts = n * f * 2 * 4
    combine = n * 4 + 2 * n * h * 4
    assert moe_activation_bytes(config, t, B) == router + dispatch + experts + combine
    # TP2 halves the experts' hidden activations only
    assert moe_activation_bytes(config, t, B, 2) == router + dispatch + experts // 2 + combine


def test_expert_parallel_terms_on_balanced_routing() -> None:
    """Balanced routing (each rank's experts receive its own N = T k rows): alltoall adds the
    two int64 regrouping orders; allgather keeps what one rank keeps."""
    config = _config("softmax top-2")
    t = S * B
    one = moe_activation_bytes(config, t, B)
    assert moe_activation_bytes(config, t, B, ep=4, dispatcher="allgather") == one
    assert moe_activation_bytes(config, t, B, ep=4, dispatcher="alltoall") == one + 2 * t * 2 * 8
    capped = _config("capacity probs")  # C = ceil(32 x 2 / 4 x 0.5) = 8 per expert
    assert expert_rows(capped, t) == 32
    padded = _config("capacity padded")  # C = 12, E C = 48 rows
    assert expert_rows(padded, t) == 48
