"""The MoE layer against Megatron-Core 0.16.1's own `MoELayer` (router, token dispatcher,
SequentialMLP experts, shared expert), built on CPU in a forked gloo rank with the same weights:
outputs, the input's, router's and experts' gradients (including the auxiliary losses'
gradients), and the balancing loss it tracks. Megatron-Core is the reference for "routing
follows Megatron-Core's semantics"; it runs here with its hard-coded CUDA calls made CPU no-ops
(`tests/megatron_lm_checkpoints.patch_cuda_calls`) and, without TransformerEngine, the router's
missing `te_general_gemm` name defined as None (its own fallback path then runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.config import ModelConfig, MoEConfig
from megapipe.model.moe import MoELayer
from megapipe.parallel.state import Group
from megapipe.testing import run_distributed

H, FFN, E, S, B = 16, 24, 4, 6, 2
TOLERANCE = 1e-5

CASES = {
    # id: (Megatron-Core TransformerConfig fields, megapipe MoEConfig fields)
    "softmax-top2-aux": (
        {"moe_router_topk": 2, "moe_aux_loss_coeff": 1.0},
        {"moe_router_topk": 2, "moe_aux_loss_coeff": 1.0},
    ),
    "pre-softmax-top2": (
        {"moe_router_topk": 2, "moe_router_pre_softmax": True, "moe_aux_loss_coeff": 1.0},
        {"moe_router_topk": 2, "moe_router_pre_softmax": True, "moe_aux_loss_coeff": 1.0},
    ),
    "sigmoid-top2-scaled": (
        {"moe_router_topk": 2, "moe_router_score_function": "sigmoid",
         "moe_router_topk_scaling_factor": 2.5, "moe_aux_loss_coeff": 1.0},
        {"moe_router_topk": 2, "moe_router_score_function": "sigmoid",
         "moe_router_topk_scaling_factor": 2.5, "moe_aux_loss_coeff": 1.0},
    ),
    "seq-aux-loss-and-z-loss": (
        {"moe_router_topk": 2, "moe_router_load_balancing_type": "seq_aux_loss",
         "moe_aux_loss_coeff": 1.0, "moe_z_loss_coeff": 0.1},
        {"moe_router_topk": 2, "moe_router_load_balancing_type": "seq_aux_loss",
         "moe_aux_loss_coeff": 1.0, "moe_z_loss_coeff": 0.1},
    ),
    "capacity-probs": (
        {"moe_router_topk": 2, "moe_expert_capacity_factor": 1.0,
         "moe_token_drop_policy": "probs"},
        {"moe_router_topk": 2, "moe_expert_capacity_factor": 1.0,
         "moe_token_drop_policy": "probs"},
    ),
    "capacity-position": (
        {"moe_router_topk": 1, "moe_router_pre_softmax": True,
         "moe_expert_capacity_factor": 0.75, "moe_token_drop_policy": "position"},
        {"moe_router_topk": 1, "moe_router_pre_softmax": True,
         "moe_expert_capacity_factor": 0.75, "moe_token_drop_policy": "position"},
    ),
    "shared-expert": (
        {"moe_router_topk": 2, "moe_shared_expert_intermediate_size": 20},
        {"moe_router_topk": 2, "moe_shared_expert_intermediate_size": 20},
    ),
}  # fmt: skip


def _megatron_layer(fields: dict):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer as CoreMoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN,
        num_moe_experts=E, moe_token_dispatcher_type="allgather", add_bias_linear=False,
        use_cpu_initialization=True, moe_router_load_balancing_type=fields.pop(
            "moe_router_load_balancing_type", "aux_loss"), **fields,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return CoreMoELayer(config, spec.submodules.mlp.submodules)


def _copy_weights(core, ours: MoELayer) -> None:
    """Megatron-Core's router, per-expert fc1 [ffn, h] / fc2 [h, ffn] and shared expert into
    megapipe's stacked [E, ffn, h] / [E, h, ffn] experts."""
    with torch.no_grad():
        ours.router.weight.copy_(core.router.weight)
        for e, expert in enumerate(core.experts.local_experts):
            ours.experts.weight1[e].copy_(expert.linear_fc1.weight)
            ours.experts.weight2[e].copy_(expert.linear_fc2.weight)
        if ours.shared_experts is not None:
            ours.shared_experts.linear_fc1.weight.copy_(core.shared_experts.linear_fc1.weight)
            ours.shared_experts.linear_fc2.weight.copy_(core.shared_experts.linear_fc2.weight)


def _grads(layer, names: dict[str, str]) -> dict[str, torch.Tensor]:
    params = dict(layer.named_parameters())
    return {key: params[name].grad.clone() for key, name in names.items()}


def _compare(rank: int, world: int, case: str) -> dict[str, float]:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from tests.megatron_lm_checkpoints import patch_cuda_calls

    patch_cuda_calls()
    if not hasattr(moe_utils, "te_general_gemm"):  # absent without TransformerEngine
        moe_utils.te_general_gemm = None
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()  # the previous case's tracked losses
    core_fields, our_fields = CASES[case]
    torch.manual_seed(0)
    core = _megatron_layer(dict(core_fields))
    core.set_layer_number(1)  # Megatron-Core tracks its losses by (1-based) layer number
    with torch.no_grad():
        for p in core.parameters():
            p.normal_(0.0, 0.3)
    config = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, vocab_size=64,
                         seq_length=S, ffn_hidden_size=FFN, add_bias_linear=False,
                         moe=MoEConfig(num_experts=E, **our_fields))  # fmt: skip
    ours = MoELayer(config, Group.single(), output_init_std=0.02)
    _copy_weights(core, ours)
    plain_config = dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None))  # fmt: skip
    plain = MoELayer(plain_config, Group.single(), output_init_std=0.02)  # the controls
    _copy_weights(core, plain)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, layer in (("core", core), ("ours", ours), ("plain", plain)):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        (out * upstream).sum().backward()
        results[name] = (out.detach(), xi.grad)
    diffs = {
        "output": (results["core"][0] - results["ours"][0]).abs().max().item(),
        "input grad": (results["core"][1] - results["ours"][1]).abs().max().item(),
    }
    core_grads = _grads(core, {"router": "router.weight"} | {
        f"fc1[{e}]": f"experts.local_experts.{e}.linear_fc1.weight" for e in range(E)} | {
        f"fc2[{e}]": f"experts.local_experts.{e}.linear_fc2.weight" for e in range(E)})  # fmt: skip
    params = dict(ours.named_parameters())
    our_grads = {"router": params["router.weight"].grad}
    for e in range(E):
        our_grads[f"fc1[{e}]"] = params["experts.weight1"].grad[e]
        our_grads[f"fc2[{e}]"] = params["experts.weight2"].grad[e]
    for key, grad in core_grads.items():
        diffs[f"grad {key}"] = (grad - our_grads[key]).abs().max().item()
    tracked = {name: float(tracker[name]["values"][0]) for name in tracker}
    assert set(tracked) == set(ours.losses.values), (tracked, ours.losses.values)
    for name, value in tracked.items():  # Megatron-Core's tracked value, coefficient removed
        diffs[f"{name} (relative)"] = abs(value - float(ours.losses.values[name][0])) / value
    controls = {  # what the case changes, so that agreeing on it means something
        "output change": (results["ours"][0] - results["plain"][0]).abs().max().item(),
        "router grad change": (
            params["router.weight"].grad - dict(plain.named_parameters())["router.weight"].grad
        )
        .abs()
        .max()
        .item(),
        "output scale": results["core"][0].abs().max().item(),
    }
    return {"diffs": diffs, "controls": controls}


def _compare_all(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every case in one forked rank (Megatron-Core imports once)."""
    return {case: _compare(rank, world, case) for case in CASES}


@pytest.fixture(scope="module")
def differences() -> dict[str, dict[str, float]]:
    return run_distributed(_compare_all, 1)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_the_moe_layer_equals_megatron_cores(differences, case: str) -> None:
    diffs, controls = differences[case]["diffs"], differences[case]["controls"]
    print(f"\n{case}: worst {max(diffs.values()):.1e}; " + ", ".join(
        f"{k} {v:.1e}" for k, v in {**diffs, **controls}.items()))  # fmt: skip
    assert controls["output scale"] > 0.1  # a zero output would match trivially
    for what, diff in diffs.items():
        assert diff < TOLERANCE, (case, what, diff, diffs)
    core_fields = CASES[case][0]
    if core_fields.get("moe_aux_loss_coeff") or core_fields.get("moe_z_loss_coeff"):
        assert any("loss" in what for what in diffs)  # the tracked losses were compared
        assert controls["router grad change"] > 100 * TOLERANCE  # the aux losses' gradients
    if "moe_expert_capacity_factor" in core_fields:
        assert controls["output change"] > 100 * TOLERANCE  # tokens were dropped
