"""`tools/checkpoint/convert.py` with MoE checkpoints: a 1-rank MoE checkpoint (sigmoid routing
with the expert bias; all layers MoE, or layer 0 only: Megatron-Core's per-layer keys) rewritten
at TP2 x PP2 (torch_dist) and from there in the legacy torch format holds the very same model
tensors, routers' expert biases included; and a legacy-format MoE run resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megapipe.conversion.convert import read_source, resolve
from tests.helpers import convert_gpt as tool
from tests.helpers import run
from tests.test_moe_checkpoint import ARGV, EXPERT_BIAS, _numbers


def _tensors(load_dir: Path) -> dict[str, torch.Tensor]:
    return read_source(resolve(str(load_dir))[0], say=lambda _: None).tensors


@pytest.mark.parametrize("freq", ["1", "[1,0]"])
def test_moe_checkpoints_convert_between_layouts_and_formats(freq: str, tmp_path: Path) -> None:
    flags = [*ARGV, *EXPERT_BIAS, "--moe-layer-freq", freq, "--train-iters", "2"]
    run(1, [*flags, "--save", str(tmp_path / "one")])
    original = _tensors(tmp_path / "one")
    bias = [k for k in original if k.endswith("mlp.router.expert_bias")]
    assert len(bias) == 1 and original[bias[0]].abs().max() > 0  # moved by two steps
    assert tool("--load-dir", str(tmp_path / "one"), "--save-dir", str(tmp_path / "tp2pp2"),
                "--target-tensor-parallel-size", "2",
                "--target-pipeline-model-parallel-size", "2") == 0  # fmt: skip
    legacy = ["--target-tensor-parallel-size", "2", "--target-ckpt-format", "torch"]
    assert tool("--load-dir", str(tmp_path / "tp2pp2"), "--save-dir", str(tmp_path / "legacy"),
                *legacy) == 0  # fmt: skip
    for name in ("tp2pp2", "legacy"):
        converted = _tensors(tmp_path / name)
        assert sorted(converted) == sorted(original), name
        for key, tensor in original.items():
            assert torch.equal(converted[key], tensor), (name, key)


def test_a_legacy_format_moe_run_resumes_exactly(tmp_path: Path) -> None:
    flags = [*ARGV, *EXPERT_BIAS, "--ckpt-format", "torch"]
    whole, _ = run(1, flags)
    run(1, [*flags, "--save", str(tmp_path / "ck"), "--exit-interval", "2"])
    resumed, _ = run(1, [*flags, "--load", str(tmp_path / "ck")])
    assert _numbers(resumed) == _numbers(whole[2:])
