"""`--ckpt-format torch`: Megatron's legacy per-rank layout. A run stopped at k and resumed
from it prints the same losses and grad norms as the run that never stopped (1 rank; TP2 x PP2
x DP2 interleaved with the distributed optimizer); the files are where Megatron puts them and
load with weights_only; another layout is refused with a pointer to the converter."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.legacy_torch import read_file
from megapipe.testing import DistributedTestError
from tests.helpers import MOCK, MODEL, NO_DROPOUT, THREE_D, printed, run

TORCH = ["--ckpt-format", "torch"]


def stop_and_resume(world: int, flags: list[str], save: Path, k: int = 3):
    whole, whole_out = run(world, flags)
    first, _ = run(world, flags + TORCH + ["--save", str(save), "--exit-interval", str(k)])
    second, second_out = run(world, flags + TORCH + ["--load", str(save), "--save", str(save)])
    return whole, whole_out, first + second, second_out


@pytest.mark.parametrize(
    ("world", "layout", "files"),
    [
        (1, [], ["mp_rank_00/model_optim_rng.pt"]),
        pytest.param(
            8,
            THREE_D,
            [
                f"mp_rank_{t:02d}_{p:03d}/{name}"
                for t in range(2)
                for p in range(2)
                for name in ("model_optim_rng.pt", "distrib_optim_000.pt", "distrib_optim_001.pt")
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["one-rank", "tp2-pp2-dp2-distopt-interleaved"],
)
def test_legacy_resume_is_exact(world, layout, files, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = MODEL + MOCK + NO_DROPOUT + layout
    whole, whole_out, resumed, resumed_out = stop_and_resume(world, flags, save)
    assert [(r.lm_loss, r.grad_norm) for r in resumed] == [(r.lm_loss, r.grad_norm) for r in whole]
    assert printed(resumed_out) == {i: v for i, v in printed(whole_out).items() if i > 3}
    it3 = save / "iter_0000003"
    written = sorted(str(p.relative_to(it3)) for p in it3.rglob("*.pt"))
    assert written == sorted(files)
    data = read_file(str(it3 / files[0]))
    assert data["checkpoint_version"] == 3.0 and data["iteration"] == 3
    assert all(isinstance(v, str) for v in data["megapipe_args"].values())
    args = data["args"]  # Megatron-LM's Namespace, typed
    assert isinstance(args, argparse.Namespace) and args.num_layers == 4 and args.iteration == 3
    assert args.padded_vocab_size == 128 * args.tensor_model_parallel_size
    chunks = [k for k in data if k.startswith("model")]
    assert chunks == (["model"] if world == 1 else ["model0", "model1"])
    names = set(data[chunks[0]])
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in names
    if world > 1:  # one layer per chunk, numbered from 0 within it as Megatron does
        assert not any(n.startswith("decoder.layers.1.") for n in names)
    assert isinstance(
        data[chunks[0]]["decoder.layers.0.self_attention.linear_qkv.weight"], torch.Tensor
    )


def test_legacy_checkpoint_at_another_layout_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = MODEL + MOCK + NO_DROPOUT + ["--train-iters", "1"]
    run(2, flags + TORCH + ["--tensor-model-parallel-size", "2", "--save", str(save)])
    with pytest.raises(DistributedTestError) as error:
        run(1, flags + ["--train-iters", "2", "--load", str(save)])
    message = str(error.value)
    assert "saved at TP 2 x PP 1" in message and "tools/checkpoint/convert.py" in message
