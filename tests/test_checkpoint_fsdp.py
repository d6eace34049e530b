"""Checkpoints under sharded data parallelism (ZeRO-2/3 on FSDP2): saved under any strategy,
loaded under any other, optimizer state included, in the one torch_dist format.

FSDP2 holds each parameter as rows of the TP-local tensor on each DP rank; the checkpoint maps
those rows to the same logical tensors the distributed optimizer's flat ranges map to, so the
files do not depend on the strategy: a ZeRO-3 save at DP4 continues under ZeRO-1 at DP2 and then
at one rank with the losses of the run that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.torch_dist import read_metadata
from tests.helpers import MOCK, MODEL, NO_DROPOUT, run

FLAGS = MODEL + MOCK + NO_DROPOUT
ZERO3 = ["--use-torch-fsdp2"]
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
ZERO1 = ["--use-distributed-optimizer"]


def _numbers(results) -> list[tuple[float, float]]:
    return [(r.lm_loss, r.grad_norm) for r in results]


def test_zero3_resumes_exactly(tmp_path: Path) -> None:
    """Stopped after 3 iterations and resumed at the same layout: the same numbers, to the
    last digit, as the run that never stopped (the fp32 shards and Adam's moments reloaded)."""
    save = tmp_path / "ckpt"
    whole, _ = run(2, FLAGS + ZERO3)
    first, _ = run(2, FLAGS + ZERO3 + ["--save", str(save), "--exit-interval", "3"])
    second, _ = run(2, FLAGS + ZERO3 + ["--load", str(save)])
    assert _numbers(first + second) == _numbers(whole)


def test_strategies_hand_a_checkpoint_on(tmp_path: Path) -> None:
    """ZeRO-3 at DP4 -> ZeRO-1 at DP2 -> one rank -> hybrid ZeRO-1 (2 x 2) -> hybrid ZeRO-2
    (2 x 2): each continues with the uninterrupted run's losses and grad norms."""
    whole, _ = run(1, FLAGS + ["--train-iters", "8"])
    a, b, c, d = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"
    hybrid = ["--num-distributed-optimizer-instances", "2"]
    stages = [
        (4, ZERO3, None, a, 2),
        (2, ZERO1, a, b, 4),
        (1, [], b, c, 6),
        (4, ZERO1 + hybrid, c, d, 7),
        (4, ZERO2 + hybrid, d, None, None),
    ]
    numbers = []
    for world, strategy, load, save, stop in stages:
        flags = FLAGS + strategy + ["--train-iters", "8"]
        flags += ["--load", str(load)] if load else []
        flags += ["--save", str(save), "--exit-interval", str(stop)] if save else []
        results, _ = run(world, flags)
        numbers += _numbers(results)
    assert len(numbers) == 8
    assert [n[0] for n in numbers] == pytest.approx([r.lm_loss for r in whole], rel=1e-5)
    assert [n[1] for n in numbers] == pytest.approx([r.grad_norm for r in whole], rel=1e-5)


def _tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    meta = read_metadata(str(directory))
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if hasattr(md, "size") and not key.startswith("rng_state.")
    }


@pytest.mark.parametrize("dtype", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_the_files_do_not_depend_on_the_strategy(tmp_path: Path, dtype: list[str]) -> None:
    """The same tensors (names, global shapes, dtypes) as ZeRO-1 writes: the weights in the
    training dtype, bf16's fp32 masters beside them, Adam's moments, Megatron-Core's names."""
    flags = FLAGS + dtype + ["--train-iters", "1", "--num-layers", "2"]
    run(2, flags + ZERO1 + ["--save", str(tmp_path / "zero1")])
    run(2, flags + ZERO3 + ["--save", str(tmp_path / "zero3")])
    zero1, zero3 = (
        _tensors(tmp_path / "zero1" / "iter_0000001"),
        _tensors(tmp_path / "zero3" / "iter_0000001"),
    )
    assert zero3 == zero1
    weight = "decoder.layers.mlp.linear_fc1.weight"
    assert zero3[weight][1] == (torch.bfloat16 if dtype else torch.float32)
    assert (f"optimizer.state.fp32_param.{weight}" in zero3) == bool(dtype)
    assert f"optimizer.state.exp_avg_sq.{weight}" in zero3


def test_bf16_zero3_resumes_exactly(tmp_path: Path) -> None:
    """bf16: the fp32 shards come back from the saved masters, not from the bf16 weights."""
    flags = FLAGS + ["--bf16", "--num-layers", "2", "--hidden-size", "16"] + ZERO3
    save = tmp_path / "ckpt"
    whole, _ = run(2, flags)
    first, _ = run(2, flags + ["--save", str(save), "--exit-interval", "3"])
    second, _ = run(2, flags + ["--load", str(save)])
    assert _numbers(first + second) == _numbers(whole)
