"""MoE checkpoints through the training product: a 1-rank MoE run saved at iteration 2
continues at TP2, PP2 and DP2 with the distributed optimizer to the losses and grad norms of
the run that never stopped (1e-5 relative; at one rank, exactly); a run saved at expert-
parallel size 4 continues at EP2 (with the distributed optimizer) and at one rank, with the
router's expert bias (a buffer, moved outside the optimizer) coming back too; and the
checkpoint holds Megatron-Core's MoE key names and shapes (SequentialMLP's
`experts.experts.linear_fc1.weight` [L, E, fc1, h], unstacked `decoder.layers.<i>.*` keys when
only some layers are MoE)."""

from __future__ import annotations

from pathlib import Path

from megapipe.checkpointing.torch_dist import read_metadata, sharded_keys
from megapipe.checkpointing.tracker import iteration_dir
from tests.helpers import run

ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
    "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "100",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
    "--eval-iters", "0", "--log-interval", "1", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--swiglu", "--attention-dropout", "0",
    "--hidden-dropout", "0",
]  # fmt: skip
EXPERT_BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "1e-2"]  # fmt: skip
LAYOUTS = {
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "DP2 distributed optimizer": (2, ["--use-distributed-optimizer"]),
}
K = 2


def _numbers(results) -> list[tuple[float, float]]:
    return [(r.lm_loss, r.grad_norm) for r in results]


def _close(a, b, tolerance: float = 1e-5) -> bool:
    return all(abs(x - y) <= tolerance * abs(x) for p, q in zip(a, b) for x, y in zip(p, q))


def _save_at_k(flags: list[str], save: Path) -> list:
    first, _ = run(1, [*flags, "--save", str(save), "--exit-interval", str(K)])
    assert len(first) == K
    return first


def test_an_moe_checkpoint_continues_at_other_layouts(tmp_path: Path) -> None:
    whole, _ = run(1, ARGV)
    save = tmp_path / "ckpt"
    first = _save_at_k(ARGV, save)
    assert _numbers(first) == _numbers(whole[:K])
    keys = sharded_keys(iteration_dir(str(save), K))
    assert keys["decoder.layers.mlp.router.weight"] == (2, 4, 32)
    assert keys["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 4, 2 * 64, 32)
    assert keys["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (2, 4, 32, 64)
    assert keys["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert keys["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == (2, 32)
    assert "decoder.layers.mlp.linear_fc1.weight" not in keys
    for layout, (world, flags) in LAYOUTS.items():
        _continues(whole, run(world, [*ARGV, *flags, "--load", str(save)])[0], layout)


def _continues(whole: list, resumed: list, what: str) -> None:
    expected, got = _numbers(whole[K:]), _numbers(resumed)
    worst = max(abs(x - y) / abs(x) for p, q in zip(expected, got) for x, y in zip(p, q))
    print(f"\n{what}: resumed at iteration {K}, largest relative difference {worst:.1e}")
    assert len(got) == len(expected) and _close(expected, got), (what, expected, got)


def test_a_checkpoint_saved_at_ep4_continues_at_ep2_and_one_rank(tmp_path: Path) -> None:
    """Each EP rank writes its block of experts (dimension 0 offset by its EP rank); a load
    reads whatever block its own EP rank holds. Sigmoid routing with the expert bias, which
    only matches when the bias (written once, replicated) came back; MoE on layer 0 only, so
    the keys are per layer, as Megatron-Core's non-homogeneous layers."""
    flags = [*ARGV, *EXPERT_BIAS, "--moe-layer-freq", "[1,0]"]
    whole, _ = run(1, flags)
    save = tmp_path / "ep4"
    first, _ = run(4, [*flags, "--expert-model-parallel-size", "4", "--save", str(save),
                       "--exit-interval", str(K)])  # fmt: skip
    assert _close(_numbers(whole[:K]), _numbers(first))
    directory = iteration_dir(str(save), K)
    keys = sharded_keys(directory)
    assert keys["decoder.layers.0.mlp.router.expert_bias"] == (4,)
    assert keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (4, 128, 32)
    assert keys["optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts.linear_fc2.weight"]
    assert keys["decoder.layers.1.mlp.linear_fc1.weight"] == (128, 32)
    assert keys["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] == (32,)
    entries = read_metadata(directory).state_dict_metadata
    assert "decoder.layers.0.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in entries
    assert "decoder.layers.1.mlp.linear_fc2._extra_state/shard_0_1" in entries
    ep2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    _continues(whole, run(2, [*flags, *ep2, "--load", str(save)])[0], "EP4 -> EP2 distopt")
    _continues(whole, run(1, [*flags, "--load", str(save)])[0], "EP4 -> 1 rank")
    # experts sharded over expert DP (EP2 of DP4): the distributed optimizer writes each
    # rank's part of the experts' state; FSDP2 (ZeRO-3) reads it into its own shards
    save = tmp_path / "ep2_of_dp4"
    sharded = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    first, _ = run(4, [*flags, *sharded, "--save", str(save), "--exit-interval", str(K)])
    assert _close(_numbers(whole[:K]), _numbers(first))
    zero3 = ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"]
    _continues(whole, run(4, [*flags, *zero3, "--load", str(save)])[0], "EP2/DP4 -> ZeRO-3")
