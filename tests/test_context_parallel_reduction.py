"""Context parallelism's gradient reduction: gradients are averaged, and the distributed
optimizer and FSDP2 shard, over DP x CP (`ParallelState.dp_cp`, the ranks that hold one
replica's parameters), as Megatron-Core does; the norms count each element once. At CP 1
`dp_cp` is the DP group itself, so every group used is the one used before CP.

World 4 = CP2 x DP2 (TP = PP = 1): rank = cp_rank + 2 x dp_rank, so the CP groups are
[0, 1] and [2, 3], the DP groups [0, 2] and [1, 3], and DP x CP is [0, 1, 2, 3]."""

from __future__ import annotations

import math

import pytest
import torch

from megapipe.activity import Activity
from megapipe.arguments import parse_args
from megapipe.checkpointing import run_state
from megapipe.checkpointing.megatron_args import _namespace
from megapipe.config import ModelConfig, OptimizerConfig
from megapipe.distributed.finalize_grads import finalize_model_grads
from megapipe.distributed.fsdp import data_parallel_mesh, describe_sharding, shard_group_size
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.training.tensorboard_log import TrainingTensorBoard

SIZES = (600, 500, 300)  # three parameters over two buckets (bucket_size 700)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _rank_grad(rank: int, i: int, n: int) -> torch.Tensor:
    """Rank `rank`'s gradient of parameter i: different on every rank, CP ranks included."""
    return torch.arange(n, dtype=torch.float32) * (i + 1) * 0.01 + (rank + 1) * (i + 2)


def _expected(world: int) -> list[torch.Tensor]:
    """The average over every rank of DP x CP, by hand."""
    return [sum(_rank_grad(r, i, n) for r in range(world)) / world for i, n in enumerate(SIZES)]


def _reduce(rank: int, world: int, shard: bool) -> dict:
    state = ParallelState.build(1, 1, context_parallel_size=2)
    params = _params()
    buffer = GradBuffer(
        params, state.dp_cp, num_microbatches=1, bucket_size=700, overlap=True, shard=shard
    )
    optimizer = ShardedOptimizer([buffer], state, OptimizerConfig(clip_grad=0.0), lr=0.0)
    for i, p in enumerate(params):  # one micro-batch: with overlap, each bucket starts here
        buffer.accumulate(p, _rank_grad(rank, i, p.numel()))
    buffer.finish_grad_sync()
    errors = []
    for lo, hi in buffer.shard_ranges():
        for p, want in zip(params, _expected(world)):
            s, t = max(lo, p.buffer_offset), min(hi, p.buffer_offset + p.numel())
            if s < t:
                got = buffer.grad_data[s:t]
                errors.append(
                    float((got - want[s - p.buffer_offset : t - p.buffer_offset]).abs().max())
                )
    owned = sum(hi - lo for lo, hi in buffer.shard_ranges())
    return {
        "groups": (state.cp.ranks, state.dp.ranks, state.dp_cp.ranks),
        "error": max(errors),
        "owned": owned,
        "numel": buffer.numel,
        "sharded": optimizer.sharded,
        "grad_norm": optimizer.grad_norm(),
        "params_norm": optimizer.params_norm(),
        "zeros": optimizer.num_zeros_in_grad(),
        "step_norm": optimizer.step(1e-2).grad_norm,
        "after_step": torch.cat([p.detach().reshape(-1) for p in params]),
    }


@pytest.mark.parametrize("shard", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_buckets_average_over_dp_x_cp_and_norms_count_each_element_once(shard: bool) -> None:
    results = run_distributed(_reduce, 4, shard)
    expected = _expected(4)
    want_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in expected))
    want_params = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in _params()))
    for rank, got in enumerate(results):
        c, d = rank % 2, rank // 2
        assert got["groups"] == ((2 * d, 2 * d + 1), (c, c + 2), (0, 1, 2, 3))
        assert got["error"] < 1e-5
        assert got["sharded"] == shard
        # sharded: a quarter of the (padded) buffer per rank; else the whole buffer
        assert got["owned"] == (got["numel"] // 4 if shard else got["numel"])
        assert got["grad_norm"] == pytest.approx(want_norm, rel=1e-6)
        assert got["params_norm"] == pytest.approx(want_params, rel=1e-6)
        assert got["zeros"] == 0.0  # no zero element; the sharded buffer's padding not counted
        assert got["step_norm"] == pytest.approx(want_norm, rel=1e-6)
        # every shard stepped and gathered back: the same new parameters on all four ranks
        assert torch.equal(got["after_step"], results[0]["after_step"])
    before = torch.cat([p.detach().reshape(-1) for p in _params()])
    assert not torch.allclose(results[0]["after_step"], before)


def _finalize(rank: int, world: int) -> tuple:
    """A plain `.grad` parameter (no GradBuffer): averaged over DP x CP too."""
    state = ParallelState.build(1, 1, context_parallel_size=2)
    model = torch.nn.Linear(3, 2)
    for i, p in enumerate(model.parameters()):
        p.grad = _rank_grad(rank, i, p.numel()).view_as(p).clone()
    finalize_model_grads([model], state)
    return tuple(p.grad.clone() for p in model.parameters())


def test_plain_gradients_average_over_dp_x_cp() -> None:
    model = torch.nn.Linear(3, 2)
    shapes = [p.shape for p in model.parameters()]
    want = [
        (sum(_rank_grad(r, i, s.numel()) for r in range(4)) / 4).view(s)
        for i, s in enumerate(shapes)
    ]
    for grads in run_distributed(_finalize, 4):
        for got, w in zip(grads, want):
            assert torch.allclose(got, w, atol=1e-6)


def _who_writes(rank: int, world: int, cp: int) -> dict:
    state = ParallelState.build(1, 1, context_parallel_size=cp)
    activity = Activity(state)
    activity.enter("grad-reduce", "waiting")
    optimizer_config = OptimizerConfig(use_distributed_optimizer=True)
    return {
        "same_group": state.dp_cp is state.dp,
        "model": run_state._writes_model(None, state),
        "tensorboard": TrainingTensorBoard.writes_on(state),
        "shard_group": shard_group_size(state),
        "sharding": describe_sharding(optimizer_config, state),
        "where": activity.where().split(",")[0:4],
        "layout": run_state.layout_of(state, 1),
        "mesh": data_parallel_mesh(state).mesh.tolist(),
    }


def test_cp2_writers_and_messages() -> None:
    results = run_distributed(_who_writes, 4, 2)
    assert [r["model"] for r in results] == [True, False, False, False]
    assert [r["tensorboard"] for r in results] == [True, False, False, False]
    assert all(r["shard_group"] == 4 and not r["same_group"] for r in results)
    assert results[0]["sharding"] == (
        "> sharded data parallelism: ZeRO-1 (optim) with megapipe's distributed optimizer "
        "over 4 data-parallel x context-parallel ranks"
    )
    assert results[3]["where"][0] == "rank 3 (tp 0"
    assert results[3]["where"][1:4] == [" cp 1", " pp 0", " dp 1)"]
    assert results[0]["layout"]["context_parallel_size"] == 2
    assert all(r["mesh"] == [0, 1, 2, 3] for r in results)  # FSDP2 shards over DP x CP


def test_cp1_uses_exactly_the_dp_group_and_the_texts_of_before() -> None:
    results = run_distributed(_who_writes, 2, 1)
    assert all(r["same_group"] for r in results)  # dp_cp IS dp: the very same Group object
    assert [r["model"] for r in results] == [True, False]
    assert [r["tensorboard"] for r in results] == [True, False]
    assert results[0]["sharding"] == (
        "> sharded data parallelism: ZeRO-1 (optim) with megapipe's distributed optimizer "
        "over 2 data-parallel ranks"
    )
    assert results[1]["where"][:3] == ["rank 1 (tp 0", " pp 0", " dp 1)"]
    assert "context_parallel_size" not in results[0]["layout"]  # checkpoints' layout as before
    assert all(r["mesh"] == [0, 1] for r in results)


TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "128",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _built(rank: int, world: int, extra: list[str]) -> dict:
    from megapipe.training.build import build_model_chunks_for, build_optimizer

    configs = parse_args(TINY + extra, world)
    cp = configs.parallel.context_parallel_size
    state = ParallelState.build(1, 1, context_parallel_size=cp)
    optimizer = build_optimizer(build_model_chunks_for(configs, state), configs, state)
    buffer = optimizer.buffers[0]
    buffer.finish_grad_sync()  # nothing accumulated: every bucket reduced now
    return {
        "group_is_dp_cp": all(b.dp is state.dp_cp for b in optimizer.buffers),
        "group_is_dp": all(b.dp is state.dp for b in optimizer.buffers),
        "sharded": optimizer.sharded,
        "message": buffer.activity.operation(),
    }


@pytest.mark.parametrize("world,cp", [(4, 2), (2, 1)])
def test_build_optimizer_reduces_over_dp_cp(world: int, cp: int) -> None:
    extra = ["--use-distributed-optimizer", "--context-parallel-size", str(cp)]
    for got in run_distributed(_built, world, extra):
        assert got["group_is_dp_cp"] and got["sharded"]
        assert got["group_is_dp"] == (cp == 1)  # CP 1: the very DP group of before
        if cp == 1:
            assert got["message"].endswith("over the data-parallel group (ranks [0, 1])")
        else:
            assert got["message"].endswith(
                "over the data-parallel x context-parallel group (ranks [0, 1, 2, 3])"
            )


def test_megatron_args_count_dp_without_cp() -> None:
    layout = {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 2,
        "world_size": 8,
    }
    model = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16
    )
    args = _namespace({}, model, layout, {})
    assert (args.data_parallel_size, args.context_parallel_size) == (2, 2)
    del layout["context_parallel_size"]
    args = _namespace({}, model, layout, {})
    assert (args.data_parallel_size, args.context_parallel_size) == (4, 1)
