"""tools/checkpoint/convert.py: a TP2 x PP2 torch_dist checkpoint converted to legacy TP1 x PP2
and to torch_dist TP4 x PP1 and back round-trips the weights bit-exactly, and a run loading a
converted checkpoint (weights only, --no-load-optim) gives the source layout's first loss;
bad input is one line and exit status 2."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from megapipe.conversion.convert import read_source, resolve
from tests.helpers import MOCK, MODEL, NO_DROPOUT, run

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("convert_tool", ROOT / "tools/checkpoint/convert.py")
convert_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_tool)

FLAGS = MODEL + MOCK + NO_DROPOUT
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def convert(src: Path, dst: Path, tp: int, pp: int, fmt: str = "torch_dist") -> int:
    return convert_tool.main(
        ["--model-type", "GPT", "--loader", "megapipe", "--saver", "megapipe",
         "--load-dir", str(src), "--save-dir", str(dst),
         "--target-tensor-parallel-size", str(tp),
         "--target-pipeline-model-parallel-size", str(pp), "--target-ckpt-format", fmt]
    )  # fmt: skip


def weights(load_dir: Path) -> dict[str, torch.Tensor]:
    return read_source(resolve(str(load_dir))[0], say=lambda _: None).tensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert")
    dirs = {n: root / n for n in ("src", "legacy_tp1_pp2", "dist_tp4", "back_legacy", "back_dist")}
    run(4, FLAGS + TP2_PP2 + ["--save", str(dirs["src"]), "--exit-interval", "3"])
    assert convert(dirs["src"], dirs["legacy_tp1_pp2"], 1, 2, "torch") == 0
    assert convert(dirs["src"], dirs["dist_tp4"], 4, 1) == 0
    assert convert(dirs["legacy_tp1_pp2"], dirs["back_legacy"], 2, 2) == 0
    assert convert(dirs["dist_tp4"], dirs["back_dist"], 2, 2) == 0
    return dirs


def test_weights_round_trip_bit_exactly(converted) -> None:
    source = weights(converted["src"])
    assert "decoder.layers.self_attention.linear_qkv.weight" in source
    legacy = converted["legacy_tp1_pp2"] / "iter_0000003"
    assert sorted(p.name for p in legacy.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for name in ("legacy_tp1_pp2", "dist_tp4", "back_legacy", "back_dist"):
        other = weights(converted[name])
        assert sorted(other) == sorted(source), name
        for key, tensor in source.items():
            assert torch.equal(other[key], tensor), (name, key)


def first_loss(world: int, layout: list[str], load: Path) -> float:
    flags = FLAGS + layout + ["--load", str(load), "--no-load-optim", "--train-iters", "4"]
    results, _ = run(world, flags)
    assert len(results) == 1  # continued after the checkpoint's iteration 3: it was loaded
    return results[0].lm_loss


def test_converted_checkpoint_continues_with_the_source_loss(converted) -> None:
    reference = first_loss(4, TP2_PP2, converted["src"])
    legacy = first_loss(2, ["--pipeline-model-parallel-size", "2"], converted["legacy_tp1_pp2"])
    dist = first_loss(4, ["--tensor-model-parallel-size", "4"], converted["dist_tp4"])
    assert legacy == pytest.approx(reference, rel=1e-5)
    assert dist == pytest.approx(reference, rel=1e-5)


def test_bad_input_is_one_line_and_exit_2(converted, tmp_path: Path, capsys) -> None:
    cases = [
        (tmp_path / "nowhere", 1, 1, "no such directory"),
        (converted["src"], 3, 1, "--target-tensor-parallel-size 3 does not divide"),
    ]
    broken = tmp_path / "broken"
    shutil.copytree(converted["legacy_tp1_pp2"], broken)
    shutil.rmtree(broken / "iter_0000003" / "mp_rank_00_001")
    cases.append((broken, 1, 1, "holds ['mp_rank_00_000'], its TP 1 x PP 2 layout needs"))
    for src, tp, pp, expected in cases:
        capsys.readouterr()
        assert convert(src, tmp_path / "out", tp, pp) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err
