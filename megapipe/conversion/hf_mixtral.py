"""Hugging Face Mixtral (`MixtralForCausalLM`): megapipe's MoE models with Llama's attention.

A Mixtral layer is a Llama layer whose MLP is a sparse MoE block: router `block_sparse_moe.
gate.weight` [E, h] and per expert `experts.<e>.w1` (gate, [ffn, h]), `w3` (up, [ffn, h]),
`w2` (down, [h, ffn]): SwiGLU experts without biases, on every layer. Its routing (softmax over
all experts, top-k, renormalised over the k) is megapipe's default softmax top-k (the softmax
over the k chosen logits): the same probabilities. transformers 5 fuses the experts in memory
(`mlp.experts.gate_up_proj`) but reads and writes this classic layout on disk, which is what
these functions map: megapipe's stacked `experts.experts.linear_fc1.weight` [L, E, 2 ffn, h]
holds [w1; w3] per expert, `linear_fc2.weight` [L, E, h, ffn] holds w2.

What Mixtral cannot hold is refused in one line naming the flag: shared experts, sigmoid or
pre-softmax routing, a top-k scaling factor, MoE on only some layers, biases, a capacity
factor (Mixtral is dropless). `router_aux_loss_coef` and `--moe-aux-loss-coeff` are carried
over as they are; they do not weigh the same loss (transformers' is k times Megatron's per-layer
loss, over all layers' tokens at once), and neither changes the logits.
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig, MoEConfig
from megapipe.errors import ConfigError

L = "decoder.layers."
ROUTER = L + "mlp.router.weight"
EXPERT_FC1 = L + "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = L + "mlp.experts.experts.linear_fc2.weight"
MOE = "block_sparse_moe."


def _refuse(what: str, why: str) -> None:
    raise ConfigError(f"{what} has no Hugging Face equivalent: {why}")


def check_mixtral(config: ModelConfig) -> None:
    """ConfigError naming the first MoE setting MixtralForCausalLM cannot hold (the attention,
    norms and positions are checked as Llama's)."""
    moe = config.moe
    assert moe is not None
    arch = "MixtralForCausalLM"
    if moe.moe_shared_expert_intermediate_size is not None:
        _refuse("--moe-shared-expert-intermediate-size", arch + " has no shared expert")
    if moe.moe_router_score_function != "softmax":
        what = f"--moe-router-score-function {moe.moe_router_score_function}"
        _refuse(what, arch + " routes by softmax")
    if moe.moe_router_pre_softmax:
        _refuse("--moe-router-pre-softmax", arch + " renormalises over the chosen experts")
    if moe.moe_router_topk_scaling_factor:
        _refuse("--moe-router-topk-scaling-factor", arch + " does not scale its probabilities")
    if moe.moe_layer_freq != 1:
        freq = moe.moe_layer_freq
        text = freq if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"
        _refuse(f"--moe-layer-freq {text}", arch + " has experts on every layer")
    if config.add_bias_linear:
        _refuse("--num-experts without --disable-bias-linear", arch + " has no biases")
    if moe.moe_expert_capacity_factor is not None:
        what = f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor}"
        _refuse(what, arch + " drops no tokens")


def hf_moe_fields(config: ModelConfig) -> dict:
    """config.json's MoE entries (and the experts' ffn size as intermediate_size)."""
    moe = config.moe
    assert moe is not None
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": config.moe_ffn_hidden_size,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.moe_router_topk,
        "router_aux_loss_coef": moe.moe_aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def export_moe_tensors(t: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every layer's router and experts under Mixtral's names."""
    out = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}.{MOE}"
        out[p + "gate.weight"] = t[ROUTER][i]
        for e in range(t[ROUTER].shape[1]):
            w1, w3 = t[EXPERT_FC1][i, e].chunk(2)
            out[f"{p}experts.{e}.w1.weight"], out[f"{p}experts.{e}.w3.weight"] = w1, w3
            out[f"{p}experts.{e}.w2.weight"] = t[EXPERT_FC2][i, e]
    return out


def moe_from_hf(hf: dict, directory: str) -> MoEConfig:
    """The MoEConfig of a Mixtral config.json; ConfigError for what megapipe lacks."""
    if hf.get("sliding_window") is not None:
        raise ConfigError(
            f"{directory}: sliding_window {hf['sliding_window']}: megapipe's attention is full"
        )
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConfigError(
            f"{directory}: router_jitter_noise {hf['router_jitter_noise']}: megapipe's router "
            "has no jitter"
        )
    k = int(hf.get("num_experts_per_tok", 2))
    if k < 2:
        raise ConfigError(
            f"{directory}: num_experts_per_tok {k}: megapipe's softmax top-1 needs "
            "--moe-router-pre-softmax, which is not Mixtral's routing"
        )
    return MoEConfig(
        num_experts=int(hf.get("num_local_experts", 8)),
        moe_router_topk=k,
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
    )


def moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Mixtral's MoE tensors of one layer (names after `model.layers.<i>.`), with shapes."""
    assert config.moe is not None
    h, f, experts = config.hidden_size, config.moe_ffn_hidden_size, config.moe.num_experts
    shapes = {MOE + "gate.weight": (experts, h)}
    for e in range(experts):
        p = f"{MOE}experts.{e}."
        shapes |= {p + "w1.weight": (f, h), p + "w3.weight": (f, h), p + "w2.weight": (h, f)}
    return shapes


def import_moe_tensors(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """megapipe's stacked router and experts from Mixtral's tensors (already checked)."""
    assert config.moe is not None
    routers, fc1, fc2 = [], [], []
    for i in range(config.num_layers):
        p = f"model.layers.{i}.{MOE}"
        routers.append(hf[p + "gate.weight"])
        experts = range(config.moe.num_experts)
        fc1.append(
            torch.stack(
                [
                    torch.cat([hf[f"{p}experts.{e}.w1.weight"], hf[f"{p}experts.{e}.w3.weight"]])
                    for e in experts
                ]  # fmt: skip
            )
        )
        fc2.append(torch.stack([hf[f"{p}experts.{e}.w2.weight"] for e in experts]))
    return {
        ROUTER: torch.stack(routers),
        EXPERT_FC1: torch.stack(fc1),
        EXPERT_FC2: torch.stack(fc2),
    }
