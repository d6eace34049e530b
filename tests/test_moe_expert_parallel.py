"""Expert parallelism (--expert-model-parallel-size) and its two token dispatchers.

The rank layout against groups written out by hand; the MoE layer at EP2 and EP4, with each
dispatcher, against the same layer at one rank built from the same global weights (outputs, the
input's and the router's gradients, and each rank's experts' gradients against the matching
slice of the one-rank experts'); then training: EP2, EP4, EP2 x TP2 with sequence parallelism,
EP2 x PP2, TP2 x PP2 x DP2 with EP2, the distributed optimizer and the grouped GEMM train to the
one-rank losses and grad norms (fp32, 1e-5), and a capacity factor drops the same tokens at EP2.
"""

from __future__ import annotations

import re

import pytest
import torch

from megapipe.config import ModelConfig, MoEConfig
from megapipe.model.initialization import initialize_parameters
from megapipe.model.moe import MoELayer
from megapipe.parallel.state import (
    Group,
    ParallelState,
    context_parallel_layout,
    expert_parallel_layout,
)
from megapipe.testing import run_distributed
from tests.test_moe import ARGV as MOE_ARGV
from tests.test_moe import _train

H, E, S, B = 16, 8, 6, 2


def test_expert_groups_come_from_dp_x_cp_in_megatrons_order() -> None:
    # world 16 = TP2 x CP2 x DP2 x PP2: rank = t + 2 (c + 2 (d + 2 p)); DP x CP index c + 2 d
    dp_cp = context_parallel_layout(16, 2, 2, 2)["dp_cp"]
    assert dp_cp[0] == [0, 2, 4, 6]  # tp 0, pp 0: (c, d) = (0,0) (1,0) (0,1) (1,1)
    groups = expert_parallel_layout(dp_cp, 2)
    assert groups["ep"][:2] == [[0, 2], [4, 6]]
    assert groups["expert_dp"][:2] == [[0, 4], [2, 6]]
    every = sorted(r for g in groups["ep"] for r in g)
    assert every == list(range(16))  # each rank in exactly one EP group
    with pytest.raises(Exception, match="--expert-model-parallel-size \\(3\\) does not divide"):
        expert_parallel_layout(dp_cp, 3)


def _config(dispatcher: str, **moe: object) -> ModelConfig:
    return ModelConfig(
        num_layers=2, hidden_size=H, num_attention_heads=2, vocab_size=64, seq_length=S,
        ffn_hidden_size=12, swiglu=True, add_bias_linear=True,
        moe=MoEConfig(num_experts=E, moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.1,
                      **moe),
    )  # fmt: skip


def _layer_run(rank: int, world: int, dispatcher: str, moe: dict) -> dict:
    """One MoE layer at EP `world` (or one rank): output, gradients; inputs differ per rank."""
    torch.manual_seed(0)
    config = _config(dispatcher, **moe)
    ep = Group.single()
    if world > 1:
        ep = ParallelState.build(expert_model_parallel_size=world).ep
    layer = MoELayer(config, Group.single(), output_init_std=0.3, ep=ep)
    initialize_parameters(layer, 1, 0, 1, ep.rank, ep.size)
    xs = torch.randn(world if world > 1 else 2, S, B, H, generator=torch.Generator().manual_seed(5))
    out = {"experts": {}, "outputs": [], "x_grads": [], "router": None}
    inputs = [xs[rank]] if world > 1 else list(xs)
    for x in inputs:
        x = x.clone().requires_grad_()
        y, _ = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out["outputs"].append(y.detach())
        out["x_grads"].append(x.grad)
    out["router"] = layer.router.weight.grad
    out["experts"] = {name: p.grad for name, p in layer.experts.named_parameters()}
    return out


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize(
    "moe", [{}, {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True}],
    ids=["dropless", "padded capacity"],
)  # fmt: skip
def test_layer_at_ep2_equals_one_rank_with_each_dispatcher(dispatcher: str, moe: dict) -> None:
    ranks = run_distributed(_layer_run, 2, dispatcher, moe)
    one = _layer_run(0, 1, dispatcher, moe)  # both ranks' inputs, one after the other
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["outputs"][0], one["outputs"][r], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["x_grads"][0], one["x_grads"][r], atol=1e-6, rtol=1e-5)
    # every rank's router gets only its own tokens' gradient: the sum is the one-rank one
    router = ranks[0]["router"] + ranks[1]["router"]
    torch.testing.assert_close(router, one["router"], atol=1e-6, rtol=1e-5)
    for name, grad in one["experts"].items():
        local = E // 2
        for r, got in enumerate(ranks):  # EP rank r's experts: rows [r E/2, (r+1) E/2)
            assert got["experts"][name].shape[0] == local
            torch.testing.assert_close(
                got["experts"][name], grad[r * local : (r + 1) * local], atol=1e-6, rtol=1e-5
            )


# --- training ----------------------------------------------------------------------------------

# test_moe's training model and runner, for 3 steps (a later flag wins)
ARGV = [*MOE_ARGV, "--train-iters", "3"]


def _ep(size: int, dispatcher: str) -> list[str]:
    return ["--expert-model-parallel-size", str(size), "--moe-token-dispatcher-type", dispatcher]


TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "EP2 alltoall": (2, _ep(2, "alltoall")),
    # DP4 with EP2: each expert lives on 2 ranks (expert DP 2), sharded there
    "EP2 of DP4 allgather, distributed optimizer": (
        4, _ep(2, "allgather") + ["--use-distributed-optimizer"]),
    "EP2 of DP4 alltoall, ZeRO-3 (FSDP2)": (4, _ep(2, "alltoall") + ["--use-torch-fsdp2"]),
    "EP4 alltoall, grouped GEMM": (4, _ep(4, "alltoall") + ["--moe-grouped-gemm"]),
    "EP2 x TP2 SP allgather": (4, _ep(2, "allgather") + TP2 + ["--sequence-parallel"]),
    # under NCCL's rules emulated (one queue per rank: the all-to-alls wait behind the
    # pipeline's queued transfers; the lazy connection handshake)
    "EP2 x PP2 alltoall, distributed optimizer, NCCL's rules": (
        4, _ep(2, "alltoall") + PP2 + ["--use-distributed-optimizer", "--emulate-nccl-p2p-order"]),
    "CP2 (aux loss, z-loss)": (2, ["--context-parallel-size", "2"]),
    "CP2 x DP2 with EP4 allgather": (4, _ep(4, "allgather") + ["--context-parallel-size", "2"]),
    "TP2 x PP2 x DP2 with EP2 alltoall SP, grouped GEMM": (
        8, _ep(2, "alltoall") + TP2 + PP2 + ["--sequence-parallel", "--moe-grouped-gemm"]),
}  # fmt: skip


def _worst(one: list[dict], other: list[dict]) -> float:
    pairs = [
        (a[k], b[k]) for a, b in zip(one, other, strict=True) for k in ("lm_loss", "grad_norm")
    ]
    return max(abs(a - b) / abs(a) for a, b in pairs)


COUNT = re.compile(r"model parallel rank \(0, 0\): (\d+)(?: on expert parallel rank (\d) of 2, "
                   r"of which (\d+) in its 2 experts per MoE layer \(4 in all\))?")  # fmt: skip


def test_expert_parallel_layouts_train_to_the_one_rank_losses_and_grad_norms() -> None:
    (one, one_log), = run_distributed(_train, 1, ARGV)  # fmt: skip
    for layout, (world, flags) in LAYOUTS.items():
        ranks = run_distributed(_train, world, ARGV + flags)
        other, log = ranks[-1]
        if layout == "EP2 alltoall":  # each EP rank states its share of the experts
            total = int(COUNT.search(one_log).group(1))
            (n0, r0, x0), (n1, r1, x1) = (COUNT.search(log).groups() for _, log in ranks)
            assert (r0, r1) == ("0", "1") and x0 == x1, (r0, r1, x0, x1)
            assert int(n0) == int(n1) and int(n0) - int(x0) + 2 * int(x0) == total
        worst = _worst(one, other)
        print(f"\n{layout}: largest relative difference {worst:.2e} over {len(one)} steps")
        assert worst <= 1e-5, (layout, one, other)
        for a, b in zip(one, other):
            for key, value in a["moe_losses"].items():
                assert abs(value - b["moe_losses"][key]) <= 1e-5 * value, (layout, key)


def test_capacity_dropping_at_ep2_equals_one_rank() -> None:
    argv = ARGV + ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "probs"]
    (one, _), = run_distributed(_train, 1, argv)  # fmt: skip
    dropless = run_distributed(_train, 1, ARGV + ["--train-iters", "1"])[0][0]
    change = abs(one[0]["grad_norm"] - dropless[0]["grad_norm"]) / dropless[0]["grad_norm"]
    assert change > 1e-3, change  # dropping changed the gradient
    other = run_distributed(_train, 2, argv + _ep(2, "alltoall"))[-1][0]
    worst = _worst(one, other)
    print(f"\ncapacity 0.5 at EP2 (alltoall; the layer test covers allgather): {worst:.2e}")
    assert worst <= 1e-5


def test_context_parallel_moe_with_per_sequence_balancing_equals_one_rank() -> None:
    """seq_aux_loss counts each whole sequence's routing, which CP splits over ranks."""
    argv = ARGV + ["--moe-router-load-balancing-type", "seq_aux_loss"]
    (one, _), = run_distributed(_train, 1, argv)  # fmt: skip
    assert "seq_load_balancing_loss" in one[0]["moe_losses"]
    other = run_distributed(_train, 4, argv + ["--context-parallel-size", "2"] + _ep(2, "alltoall"))
    worst = _worst(one, other[-1][0])
    print(f"\nCP2 x DP2 with EP2, seq_aux_loss: {worst:.2e}")
    assert worst <= 1e-5
    for a, b in zip(one, other[-1][0]):
        for key, value in a["moe_losses"].items():
            assert abs(value - b["moe_losses"][key]) <= 1e-5 * value, key
