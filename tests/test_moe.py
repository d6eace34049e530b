"""Mixture of experts (megapipe/model/moe*.py) against plain PyTorch written here.

The reference is a per-token loop: its own routing (top-k of the logits then a softmax over the
chosen, or the variants), each expert a plain MLP on that token, the weighted sum; the losses
come from Megatron-Core's written definitions (Switch Transformer's E x sum f_i P_i with f per
top-k slot, per sequence for seq_aux_loss, ST-MoE's z-loss); capacity from the policy's words.
Then training: a 1-rank MoE run learns and logs its balancing loss, TP2 and DP2 runs train to
its losses, and the grouped GEMM equals the loop.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig, MoEConfig
from megapipe.model.moe import DispatchPlan, MoELayer, update_expert_biases
from megapipe.model.moe_experts import Experts, grouped_mm_available
from megapipe.model.moe_losses import LOAD_BALANCING_LOSS, Z_LOSS, balancing_loss_name
from megapipe.parallel.state import Group
from megapipe.testing import run_distributed, train_with_flags

H, E, S, B = 16, 4, 6, 3  # hidden, experts, sequence, batch


def _config(swiglu: bool = False, bias: bool = True, **moe: object) -> ModelConfig:
    moe.setdefault("num_experts", E)
    return ModelConfig(
        num_layers=2, hidden_size=H, num_attention_heads=2, vocab_size=64, seq_length=S,
        ffn_hidden_size=12, swiglu=swiglu, add_bias_linear=bias, moe=MoEConfig(**moe),
    )  # fmt: skip


def _layer(config: ModelConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(config, Group.single(), output_init_std=0.3)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


# --- the plain-PyTorch reference -----------------------------------------------------------


def _mlp(x, w1, b1, w2, b2, swiglu: bool):
    h = x @ w1.t() + (b1 if b1 is not None else 0)
    if swiglu:
        half = h.shape[-1] // 2
        h = F.silu(h[..., :half]) * h[..., half:]
    else:
        h = F.gelu(h)
    return h @ w2.t() + (b2 if b2 is not None else 0)


def _route_token(logit: torch.Tensor, moe: MoEConfig, bias=None) -> list[tuple[int, torch.Tensor]]:
    """[(expert, weight)] of one token, by the routing rules written out."""
    plain = logit.detach()
    k = moe.moe_router_topk
    if moe.moe_router_score_function == "softmax":
        if moe.moe_router_pre_softmax:
            p = torch.exp(logit - logit.max())
            p = p / p.sum()
            chosen = sorted(range(E), key=lambda e: -float(p[e].detach()))[:k]
            weights = [p[e] for e in chosen]
        else:
            chosen = sorted(range(E), key=lambda e: -float(plain[e]))[:k]
            top = torch.stack([logit[e] for e in chosen])
            w = torch.exp(top - top.max())
            weights = list(w / w.sum())
    else:
        s = 1 / (1 + torch.exp(-logit))
        sel = s + (bias if bias is not None else 0)
        chosen = sorted(range(E), key=lambda e: -float(sel[e].detach()))[:k]
        weights = [s[e] for e in chosen]
        if k > 1:
            total = sum(weights)
            weights = [w / total for w in weights]
    scale = moe.moe_router_topk_scaling_factor or 1.0
    return [(e, w * scale) for e, w in zip(chosen, weights)]


def reference(layer: MoELayer, x: torch.Tensor, config: ModelConfig, keep=None):
    """Float64 output [s, b, h] and its parameters (leaves): per token, per chosen expert.
    keep: the set of (token, expert) assignments that survive (None: all)."""
    moe, ex = config.moe, layer.experts
    leaves = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    xd = x.detach().double().requires_grad_()
    tokens = xd.reshape(-1, H)
    bias = layer.router.expert_bias.double() if layer.router.expert_bias is not None else None
    rows = []
    for t in range(tokens.shape[0]):
        logit = tokens[t] @ leaves["router.weight"].t()
        out = torch.zeros(H, dtype=torch.float64)
        for e, w in _route_token(logit, moe, bias):
            if keep is not None and (t, e) not in keep:
                continue
            b1 = leaves["experts.bias1"][e] if ex.bias1 is not None else None
            b2 = leaves["experts.bias2"][e] if ex.bias2 is not None else None
            w1, w2 = leaves["experts.weight1"][e], leaves["experts.weight2"][e]
            out = out + w * _mlp(tokens[t], w1, b1, w2, b2, config.swiglu)
        if layer.shared_experts is not None:
            fc1, fc2 = "shared_experts.linear_fc1.", "shared_experts.linear_fc2."
            w1, w2 = leaves[fc1 + "weight"], leaves[fc2 + "weight"]
            b1, b2 = leaves.get(fc1 + "bias"), leaves.get(fc2 + "bias")
            out = out + _mlp(tokens[t], w1, b1, w2, b2, config.swiglu)
        rows.append(out)
    return torch.stack(rows).view(x.shape), xd, leaves


CASES = {
    "softmax top-2": dict(moe_router_topk=2),
    "pre-softmax top-2, swiglu, no bias": dict(moe_router_topk=2, moe_router_pre_softmax=True),
    "sigmoid top-2 scaled": dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                                 moe_router_topk_scaling_factor=2.5),
    "top-1 with a shared expert": dict(moe_router_topk=1, moe_shared_expert_intermediate_size=8),
    "sigmoid top-2 with an expert bias": dict(moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_a_plain_pytorch_moe_in_values_and_gradients(name: str) -> None:
    swiglu = "swiglu" in name
    config = _config(swiglu=swiglu, bias="no bias" not in name, **CASES[name])
    layer = _layer(config)
    if layer.router.expert_bias is not None:  # a bias large enough to change the selection
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.6, -0.6, 0.3]))
    x = torch.randn(S, B, H, requires_grad=True)
    out, bias = layer(x)
    assert bias is None
    expected, xd, leaves = reference(layer, x, config)
    assert (out.double() - expected).abs().max() < 1e-5
    grad = torch.randn(S, B, H)
    out.backward(grad)
    expected.backward(grad.double())
    assert (x.grad.double() - xd.grad).abs().max() < 1e-5
    for n, p in layer.named_parameters():
        assert (p.grad.double() - leaves[n].grad).abs().max() < 1e-5, n
    if "expert bias" in name:  # the bias changed which experts some tokens got
        logits = x.detach().reshape(-1, H) @ layer.router.weight.detach().t()
        plain = torch.topk(torch.sigmoid(logits), 2).indices.sort().values
        biased = torch.topk(torch.sigmoid(logits) + layer.router.expert_bias, 2).indices
        assert (plain != biased.sort().values).any()


def test_expert_bias_moves_toward_balance_after_a_step() -> None:
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01)  # fmt: skip
    layer = _layer(config)
    x = torch.randn(S, B, H)
    layer(x)[0].sum().backward()
    counts = layer.router.tokens_per_expert.clone()
    logits = x.reshape(-1, H) @ layer.router.weight.detach().t()
    expected_counts = torch.bincount(
        torch.topk(torch.sigmoid(logits), 2).indices.flatten(), minlength=E
    )
    assert counts.tolist() == expected_counts.float().tolist()
    update_expert_biases([layer], Group.single())
    mean = S * B * 2 / E
    expected = [0.01 * (1 if c < mean else -1 if c > mean else 0) for c in counts.tolist()]
    assert layer.router.expert_bias.tolist() == pytest.approx(expected)
    assert layer.router.tokens_per_expert.sum() == 0


def test_expert_bias_stays_fp32_in_a_bf16_model() -> None:
    """bf16 has 8 bits of mantissa: from 1.0 a step of 1e-3 would not move the bias at all."""
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = _layer(config).to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32
    layer.router.expert_bias.fill_(1.0)
    layer.router.update_expert_bias(torch.tensor([0.0, 1.0, 1.0, 2.0]))
    assert layer.router.expert_bias.tolist() == pytest.approx([1.001, 1.0, 1.0, 0.999])


# --- the auxiliary losses --------------------------------------------------------------------


def _aux_reference(logits: torch.Tensor, k: int, per_sequence: bool) -> torch.Tensor:
    """Switch Transformer's E x sum_i f_i P_i (f_i: share of the T x k top-k slots that chose
    expert i; P_i: mean softmax probability of i), over the micro-batch or per sequence."""
    probs = torch.softmax(logits, dim=-1)
    groups = [probs]
    if per_sequence:  # tokens are [s, b] flattened s-major: sequence j is every B-th token
        groups = [probs.view(S, B, E)[:, j] for j in range(B)]
    losses = []
    for p in groups:
        chosen = torch.topk(p, k).indices
        f = torch.stack([(chosen == i).sum() for i in range(E)]).double() / (p.shape[0] * k)
        losses.append(E * (f * p.mean(dim=0)).sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_balancing_and_z_losses_follow_megatrons_definitions(balancing: str) -> None:
    aux, z = 0.1, 0.01
    config = _config(moe_router_topk=2, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z,
                     moe_router_load_balancing_type=balancing)  # fmt: skip
    layer = _layer(config)
    x = torch.randn(S, B, H)
    out, _ = layer(x)
    (out * 0).sum().backward()  # only the auxiliary losses' gradients reach the router
    w = layer.router.weight.detach().double().requires_grad_()
    logits = x.reshape(-1, H).double() @ w.t()
    lb = _aux_reference(logits, 2, balancing == "seq_aux_loss")
    zl = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    recorded = layer.losses.values
    name = balancing_loss_name(balancing)  # Megatron's: seq_load_balancing_loss for seq_aux
    assert name == ("seq_" if balancing == "seq_aux_loss" else "") + "load_balancing_loss"
    assert float(recorded[name][0]) == pytest.approx(lb.item(), rel=1e-6)
    assert float(recorded[Z_LOSS][0]) == pytest.approx(zl.item(), rel=1e-6)
    (aux * lb + z * zl).backward()
    assert (layer.router.weight.grad.double() - w.grad).abs().max() < 1e-6
    assert w.grad.abs().max() > 1e-4  # the check can fail: the aux gradient is there


def test_eval_mode_records_no_loss_and_balancing_none_none() -> None:
    config = _config(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="none")
    layer = _layer(config)
    layer(torch.randn(S, B, H))
    assert LOAD_BALANCING_LOSS not in layer.losses.values
    layer = _layer(_config(moe_aux_loss_coeff=0.1)).eval()
    layer(torch.randn(S, B, H))
    assert layer.losses.values == {}


# --- capacity --------------------------------------------------------------------------------


def _expected_kept(logits: torch.Tensor, moe: MoEConfig, capacity: int) -> set[tuple[int, int]]:
    """The (token, expert) assignments each policy keeps, from its words."""
    by_expert: dict[int, list[tuple[int, float]]] = {e: [] for e in range(E)}
    for t in range(logits.shape[0]):
        for e, w in _route_token(logits[t], moe):
            by_expert[e].append((t, float(w)))
    kept = set()
    for e, rows in by_expert.items():
        if moe.moe_token_drop_policy == "probs":
            rows = sorted(rows, key=lambda r: -r[1])  # the highest probabilities stay
        kept |= {(t, e) for t, _ in rows[:capacity]}  # position: the earliest tokens stay
    return kept


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_exactly_what_the_policy_names(policy: str, pad: bool) -> None:
    factor = 0.5
    config = _config(moe_router_topk=2, moe_expert_capacity_factor=factor,
        moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)  # fmt: skip
    layer = _layer(config, seed=3)
    x = torch.randn(S, B, H)
    capacity = math.ceil(S * B * 2 / E * factor)  # 5 of 18 tokens x 2 slots / 4 experts
    logits = x.reshape(-1, H).double() @ layer.router.weight.detach().double().t()
    kept = _expected_kept(logits, config.moe, capacity)
    probs, routing_map = layer.router(x.reshape(-1, H), S, B)
    plan = DispatchPlan.of(routing_map)
    got = {(int(t), int(e)) for t, e in zip(plan.token_index, plan.expert_index)
           if float(probs[t, e].detach()) > 0}  # fmt: skip
    assert got == kept
    assert len(kept) < S * B * 2  # something was dropped
    if pad:
        assert plan.counts == [capacity] * E
    out, _ = layer(x)
    expected, _, _ = reference(layer, x, config, keep=kept)
    assert (out.double() - expected).abs().max() < 1e-5
    fully_dropped = [t for t in range(S * B) if not any((t, e) in kept for e in range(E))]
    assert fully_dropped, "pick a factor that drops some token entirely"
    flat = out.reshape(-1, H)
    assert all(torch.equal(flat[t], torch.zeros(H)) for t in fully_dropped)


# --- grouped GEMM ------------------------------------------------------------------------------


@pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no grouped_mm")
@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_gemm_equals_one_gemm_per_expert(swiglu: bool) -> None:
    torch.manual_seed(0)  # not whatever earlier imports left in the global generator
    config = _config(swiglu=swiglu)
    loop = Experts(config, Group.single(), E, 12, output_init_std=0.3)
    grouped = Experts(config, Group.single(), E, 12, output_init_std=0.3, grouped_gemm=True)
    with torch.no_grad():
        for a, b in zip(loop.parameters(), grouped.parameters()):
            a.normal_(0, 0.3)
            b.copy_(a)
    counts = [5, 0, 7, 4]  # an expert with no rows too
    x = torch.randn(sum(counts), H)
    assert grouped._grouped_mm_fits(x)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi, counts) for m, xi in zip((loop, grouped), xs)]
    grad = torch.randn_like(outs[0])
    for o in outs:
        o.backward(grad)
    assert (outs[0] - outs[1]).abs().max() < 1e-6
    assert (xs[0].grad - xs[1].grad).abs().max() < 1e-6
    for a, b in zip(loop.parameters(), grouped.parameters()):
        # fp32 sums over up to 7 rows in another order: a few ulps of gradients up to ~5
        assert (a.grad - b.grad).abs().max() < 1e-6 * max(1.0, float(a.grad.abs().max()))


# --- training ----------------------------------------------------------------------------------

ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
    "16", "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3", "--eval-iters", "0",
    "--log-interval", "1", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--swiglu",
]  # fmt: skip


def _train(rank: int, world: int, argv: list[str]) -> tuple[list, str]:
    results, out = train_with_flags(rank, world, argv)
    return [dataclasses.asdict(r) for r in results], out


LAYOUTS = {
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "DP2": (2, []),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "grouped GEMM": (1, ["--moe-grouped-gemm"]),
}


def test_moe_training_learns_logs_its_losses_and_other_layouts_match_one_rank() -> None:
    (one, log), = run_distributed(_train, 1, ARGV)  # fmt: skip
    losses = [r["lm_loss"] for r in one]
    print("\n1 rank: lm loss", [f"{v:.4f}" for v in losses], "load_balancing_loss",
          [f"{r['moe_losses'][LOAD_BALANCING_LOSS]:.4f}" for r in one])  # fmt: skip
    assert losses[-1] < losses[0] - 0.05, losses
    assert re.search(r"\| load_balancing_loss: \d\.\d{6}E[+-]\d\d \| z_loss: ", log), log
    assert all(0.9 < r["moe_losses"][LOAD_BALANCING_LOSS] < 2.0 for r in one)  # ~1: balanced
    for layout, (world, flags) in LAYOUTS.items():
        other = run_distributed(_train, world, ARGV + flags)[-1][0]
        worst = max(
            abs(a[k] - b[k]) / abs(a[k])
            for a, b in zip(one, other)
            for k in ("lm_loss", "grad_norm")
        )
        print(f"\n{layout}: largest relative difference {worst:.2e} over {len(one)} steps")
        for a, b in zip(one, other):
            for key in ("lm_loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, key, a, b)
            for key, value in a["moe_losses"].items():
                assert abs(value - b["moe_losses"][key]) <= 1e-5 * value, (layout, key)


def test_capacity_dropping_trains_alike_at_dp2_and_tp2() -> None:
    argv = ARGV + ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"]
    (one, _), = run_distributed(_train, 1, argv)  # fmt: skip
    dropless = run_distributed(_train, 1, ARGV)[0][0]
    assert abs(one[0]["lm_loss"] - dropless[0]["lm_loss"]) > 1e-4  # dropping changed the loss
    for world, flags in ((2, []), (2, ["--tensor-model-parallel-size", "2"])):
        other = run_distributed(_train, world, argv + flags)[-1][0]
        pairs = [(a[k], b[k]) for a, b in zip(one, other) for k in ("lm_loss", "grad_norm")]
        print(f"\ncapacity {flags or 'DP2'}: {max(abs(a - b) / abs(a) for a, b in pairs):.2e}")
        for a, b in pairs:
            assert abs(a - b) <= 1e-5 * abs(a), (flags, a, b)


def test_flops_count_the_active_experts_and_parameters_count_all() -> None:
    from megapipe.pipeline.stage_memory import layer_parameters
    from megapipe.training.flops import flops_per_iteration

    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_layer_freq=2, moe_ffn_hidden_size=24,
                    moe_shared_expert_intermediate_size=16)  # fmt: skip
    config = dataclasses.replace(_config(swiglu=True, bias=False), num_layers=4, moe=moe)
    dense = dataclasses.replace(config, moe=None)
    batch, tokens = 8, 8 * S
    extra = flops_per_iteration(config, batch, padded_vocab_size=128) - flops_per_iteration(
        dense, batch, padded_vocab_size=128
    )
    mlp = lambda f: 3 * H * f  # SwiGLU, no biases: gate, up, down  # noqa: E731
    active = 8 * H + 2 * mlp(24) + mlp(16)  # router, top-2 experts, the shared expert
    assert extra == 2 * 6 * tokens * (active - mlp(12))  # layers 0 and 2 are MoE
    every = 8 * H + 8 * mlp(24) + mlp(16)  # memory: every expert
    assert layer_parameters(config, 1, 0) - layer_parameters(dense, 1, 0) == every - mlp(12)
    assert layer_parameters(config, 1, 1) == layer_parameters(dense, 1, 1)
