"""Vocabulary padding in torch_dist checkpoints: the embedding (and its optimizer state) is saved
with the saving layout's padded rows, as Megatron-LM's model has them; a load reads the real
rows of a checkpoint with any padding, so a TP2 checkpoint (vocabulary 100 in 256 rows)
continues at TP1 (128 rows) and at TP2 x PP2 with the same losses and converts to TP1's 128
rows; an older checkpoint without padding (and with megapipe's string `args`) still loads, and
one with fewer rows than the vocabulary is refused in one line. Also the `_extra_state` entries
megapipe writes for Megatron-Core, and common.pt's loading leaving the classes other libraries
allowed process-wide (Megatron-Core allows `argparse.Namespace` on import) allowed."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.layout_free import (
    extra_state_entries,
    fit_vocabulary,
    is_vocabulary,
)
from megapipe.checkpointing.shards import TensorShard
from megapipe.checkpointing.torch_dist import load_common, load_sharded, save_sharded, sharded_keys
from megapipe.checkpointing.tracker import iteration_dir, write_tracker
from megapipe.conversion.convert import convert
from megapipe.testing import DistributedTestError
from tests.helpers import MOCK, MODEL, NO_DROPOUT, run

WORD = "embedding.word_embeddings.weight"
TP2 = ["--tensor-model-parallel-size", "2"]
FLAGS = MODEL + MOCK + NO_DROPOUT  # vocabulary 100: 128 rows at TP1, 256 at TP2


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    """A TP2 run of 6 iterations (the reference losses) that saved at iteration 3."""
    save = tmp_path_factory.mktemp("tp2")
    reference, _ = run(2, FLAGS + TP2 + ["--save", str(save), "--save-interval", "3"])
    return reference, save


def _continued(world: int, layout: list[str], load: Path) -> list:
    continued, _ = run(world, FLAGS + layout + ["--load", str(load), "--ckpt-step", "3"])
    return continued


def _same_losses(continued: list, reference: list) -> None:
    assert [r.lm_loss for r in continued] == pytest.approx(
        [r.lm_loss for r in reference[3:]], rel=1e-5
    )
    assert [r.grad_norm for r in continued] == pytest.approx(
        [r.grad_norm for r in reference[3:]], rel=1e-5
    )


def test_the_saving_layouts_padding_is_saved(saved_at_tp2) -> None:
    _, save = saved_at_tp2
    shapes = sharded_keys(iteration_dir(str(save), 3))
    assert shapes[WORD] == (256, 32)
    assert shapes[f"optimizer.state.exp_avg.{WORD}"] == (256, 32)
    common = load_common(iteration_dir(str(save), 3))
    assert common["true_vocab_size"] == 100 and common["args"].padded_vocab_size == 256


@pytest.mark.parametrize(
    ("world", "layout"), [(1, []), (4, TP2 + ["--pipeline-model-parallel-size", "2"])],
    ids=["tp1", "tp2-pp2"],
)  # fmt: skip
def test_a_padded_checkpoint_continues_at_another_padding(world, layout, saved_at_tp2) -> None:
    reference, save = saved_at_tp2
    _same_losses(_continued(world, layout, save), reference)


def test_conversion_writes_the_target_layouts_padding(saved_at_tp2, tmp_path: Path) -> None:
    _, save = saved_at_tp2
    target = convert(str(save), str(tmp_path / "tp1"), 1, 1, "torch_dist", say=lambda _: None)
    assert sharded_keys(target)[WORD] == (128, 32)
    common = load_common(target)
    assert common["true_vocab_size"] == 100 and common["args"].padded_vocab_size == 128
    assert common["args"].tensor_model_parallel_size == 1 and common["megapipe_args"]


def _rewrite(source: str, target_dir: Path, rows: int | None) -> None:
    """Copy iteration 3 of `source` to `target_dir` as megapipe wrote it before vocabulary
    padding was saved: vocabulary tensors cut to `rows` (None: the real vocabulary), the
    arguments under `args` as megapipe's dict of strings, no true_vocab_size."""
    common = load_common(source)
    saved = sharded_keys(source)
    keep = rows or common["true_vocab_size"]
    tensors, pieces = {}, {}
    for key, shape in saved.items():
        if is_vocabulary(key):
            shape = (min(keep, shape[0]), *shape[1:])
        tensors[key] = torch.empty(shape)
        pieces[key] = [TensorShard(tensors[key], (0,) * len(shape), shape)]
    load_sharded(source, pieces, group=None, fit=fit_vocabulary)  # the first `keep` rows
    old = {k: v for k, v in common.items() if k not in ("megapipe_args", "true_vocab_size")}
    old["args"] = common["megapipe_args"]
    whole = {k: [TensorShard(t, (0,) * t.dim(), tuple(t.shape))] for k, t in tensors.items()}
    save_sharded(iteration_dir(str(target_dir), 3), whole, old, group=None, coordinator=True)
    write_tracker(str(target_dir), 3)


def test_an_unpadded_checkpoint_still_loads(saved_at_tp2, tmp_path: Path) -> None:
    reference, save = saved_at_tp2
    _rewrite(iteration_dir(str(save), 3), tmp_path / "old", rows=None)
    assert sharded_keys(iteration_dir(str(tmp_path / "old"), 3))[WORD] == (100, 32)
    _same_losses(_continued(1, [], tmp_path / "old"), reference)


def test_too_few_vocabulary_rows_are_refused_in_one_line(saved_at_tp2, tmp_path: Path) -> None:
    _, save = saved_at_tp2
    _rewrite(iteration_dir(str(save), 3), tmp_path / "cut", rows=99)
    with pytest.raises(DistributedTestError) as error:
        _continued(1, [], tmp_path / "cut")
    assert f"tensor {WORD} has 99 vocabulary rows, fewer than this model's vocabulary of 100" in (
        str(error.value)
    )


def test_fit_vocabulary_aims_only_the_vocabulary_at_the_checkpoints_rows() -> None:
    dest = torch.zeros(50, 4)
    shards = {
        WORD: [TensorShard(dest, (50, 0), (100, 4))],
        f"optimizer.state.exp_avg.{WORD}": [TensorShard(dest, (0, 0), (100, 4))],
        "decoder.final_layernorm.weight": [TensorShard(torch.zeros(4), (0,), (4,))],
    }
    saved = {WORD: (256, 4), f"optimizer.state.exp_avg.{WORD}": (128, 4),
             "decoder.final_layernorm.weight": (4,)}  # fmt: skip
    fitted = fit_vocabulary(shards, saved, "ckpt")
    assert fitted[WORD][0].global_shape == (256, 4) and fitted[WORD][0].offsets == (50, 0)
    assert fitted[f"optimizer.state.exp_avg.{WORD}"][0].global_shape == (128, 4)
    assert fitted["decoder.final_layernorm.weight"] == shards["decoder.final_layernorm.weight"]
    assert fitted[WORD][0].tensor is dest  # still the destination, filled in place
    message = (
        r"^checkpoint ckpt: tensor output_layer.weight has 99 vocabulary rows, fewer than this "
        r"model's vocabulary of 100$"
    )
    with pytest.raises(CheckpointError, match=message):
        output = {"output_layer.weight": [TensorShard(dest, (0, 0), (100, 4))]}
        fit_vocabulary(output, {"output_layer.weight": (99, 4)}, "ckpt")


def test_extra_state_entries_are_megatron_cores_names() -> None:
    entries = extra_state_entries([3, 2, 3], 4)
    assert sorted(entries) == sorted(
        f"decoder.layers.{site}._extra_state/shard_{i}_4"
        for i in (2, 3)
        for site in ("self_attention.linear_proj", "self_attention.linear_qkv",
                     "mlp.linear_fc1", "mlp.linear_fc2")
    )  # fmt: skip
    assert torch.load(io.BytesIO(entries[next(iter(entries))]), weights_only=True) == [None]


def test_loading_common_pt_keeps_what_others_allowed(saved_at_tp2) -> None:
    _, save = saved_at_tp2
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([argparse.Namespace])  # as Megatron-Core's import
    try:
        assert isinstance(load_common(iteration_dir(str(save), 3))["args"], argparse.Namespace)
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
