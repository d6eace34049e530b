"""Which checkpoint a run loads and what it restores, decided once for both formats: the
tracker's `checkpoint_to_load` (a missing `--ckpt-step` lists the iterations that exist), the
load plan (`--finetune`, `--no-load-optim`, `--no-load-rng`, the notes), and a save into a used
`--save` folder (Megatron's tracker, newer iterations of an earlier run moved aside, one line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megapipe.checkpointing.load_plan import Held, Request, plan_load
from megapipe.checkpointing.run_state import Progress
from megapipe.checkpointing.tracker import (
    RELEASE,
    checkpoint_path,
    checkpoint_to_load,
    iteration_dir,
    point_tracker,
    read_tracker,
    saved_iterations,
    write_tracker,
)
from megapipe.config import CheckpointConfig
from megapipe.errors import ConfigError
from megapipe.testing import run_distributed, train_with_flags

LAYOUT = {
    "world_size": 2,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": 1,
}


def _saved(root: Path, *iterations: int) -> str:
    for iteration in iterations:
        Path(iteration_dir(str(root), iteration)).mkdir(parents=True)
    return str(root)


def test_saved_iterations_are_complete_iteration_directories_only(tmp_path: Path) -> None:
    save = _saved(tmp_path, 4, 2, 10)
    (tmp_path / "iter_0000006.tmp-1-ab").mkdir()  # a crashed save's temp sibling
    (tmp_path / "iter_0000008").write_text("")  # a file, not a checkpoint
    (tmp_path / "iter_0000012.superseded").mkdir()
    assert saved_iterations(save) == [2, 4, 10]
    assert saved_iterations(str(tmp_path / "absent")) == []


def test_a_missing_ckpt_step_lists_the_iterations_that_exist(tmp_path: Path) -> None:
    save = _saved(tmp_path / "ckpt", 2, 4)
    load = CheckpointConfig(load=save, ckpt_step=7)
    message = r"^--ckpt-step 7: .*iter_0000007 does not exist \(iterations saved there: 2, 4\)$"
    with pytest.raises(ConfigError, match=message):
        checkpoint_to_load(load)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"\(no iterations are saved there\)$"):
        checkpoint_to_load(CheckpointConfig(load=str(empty), ckpt_step=7))
    assert checkpoint_to_load(CheckpointConfig(load=save, ckpt_step=2)) == 2


def test_checkpoint_to_load_follows_the_tracker(tmp_path: Path) -> None:
    save = _saved(tmp_path, 2, 4)
    assert checkpoint_to_load(CheckpointConfig()) is None
    assert checkpoint_to_load(CheckpointConfig(load=save)) is None  # no tracker: from scratch
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint is set"):
        checkpoint_to_load(CheckpointConfig(load=save, exit_on_missing_checkpoint=True))
    write_tracker(save, 2)
    assert checkpoint_to_load(CheckpointConfig(load=save)) == 2
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")  # Megatron's
    with pytest.raises(ConfigError, match="names release, but .*release does not exist"):
        checkpoint_to_load(CheckpointConfig(load=save))
    (tmp_path / "release").mkdir()
    assert checkpoint_to_load(CheckpointConfig(load=save)) == RELEASE
    assert checkpoint_path(save, RELEASE) == str(tmp_path / "release")


def test_saving_below_an_earlier_runs_iterations_moves_them_aside(tmp_path: Path) -> None:
    save = _saved(tmp_path, 2, 4, 6)
    write_tracker(save, 6)  # an earlier run that went to iteration 6
    warning = point_tracker(save, 2)  # this run has just saved iteration 2 again
    assert read_tracker(save) == 2  # Megatron's: the iteration just saved
    assert saved_iterations(save) == [2]  # nothing newer left looking valid
    assert warning == (
        f"{save} held iterations newer than the 2 just saved, left by an earlier run: "
        "iter_0000004, iter_0000006; moved aside as <name>.superseded (the tracker names 2)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002",
        "iter_0000004.superseded",
        "iter_0000006.superseded",
        "latest_checkpointed_iteration.txt",
    ]
    _saved(tmp_path, 4)  # this run goes on to 4, a third run saves 2 again: nothing is lost
    point_tracker(save, 4)
    assert "iter_0000004" in point_tracker(save, 2)
    assert (tmp_path / "iter_0000004.superseded-2").is_dir()
    assert (tmp_path / "iter_0000004.superseded").is_dir()


def test_saving_the_newest_iteration_warns_of_nothing(tmp_path: Path) -> None:
    save = _saved(tmp_path, 2, 4)
    assert point_tracker(save, 4) is None
    assert point_tracker(save, 4) is None  # saved again (same iteration): nothing is newer
    assert saved_iterations(save) == [2, 4] and read_tracker(save) == 4


# --- the load plan ----------------------------------------------------------------------------


def _plan(held: Held, **flags: bool) -> tuple[bool, bool, bool, list[str]]:
    plan = plan_load(CheckpointConfig(load="x", **flags), "x/iter_0000005", 5, held, LAYOUT)
    return plan.weights_only, plan.optimizer, plan.rng, list(plan.notes[1:])


def test_the_load_plan_applies_the_flags_and_what_the_checkpoint_holds() -> None:
    full = Held(has_optimizer=True, has_rng=True, layout=dict(LAYOUT))
    assert _plan(full) == (False, True, True, [])
    assert _plan(full, finetune=True) == (True, False, False, [])
    assert _plan(full, no_load_optim=True) == (False, False, True, [])
    assert _plan(full, no_load_rng=True) == (False, True, False, [])
    bare = Held(has_optimizer=False, has_rng=False, layout=dict(LAYOUT))
    note = "x/iter_0000005 holds no optimizer state: the optimizer starts afresh"
    assert _plan(bare) == (False, False, False, [note])
    assert _plan(bare, no_load_optim=True) == (False, False, False, [])  # asked for none: silent
    wider = Held(has_optimizer=True, has_rng=True, layout={**LAYOUT, "world_size": 4})
    weights_only, optimizer, rng, notes = _plan(wider)
    assert (weights_only, optimizer, rng) == (False, True, False)
    assert notes == [
        "random states not restored: saved at TP2 x PP1 over 4 ranks, loading at TP2 x PP1 over "
        "2 ranks (dropout masks depend on the samples only, so training is unaffected)"
    ]


def test_the_load_plan_says_where_training_continues() -> None:
    held = Held(has_optimizer=True, has_rng=False, layout=None)
    saved = Progress(5, 40, 40, {"validation": 1})
    plan = plan_load(CheckpointConfig(load="x"), "d", 5, held, LAYOUT)
    assert plan.notes[0] == "loading checkpoint from d at iteration 5"
    assert plan.progress(saved) == saved
    finetune = plan_load(CheckpointConfig(load="x", finetune=True), "d", 5, held, LAYOUT)
    assert finetune.progress(saved) == Progress(0, 0, 0, {})
    assert Request.of(CheckpointConfig(finetune=True, no_load_optim=False)).optimizer is False


# --- through the training product: the demo re-run ---------------------------------------------

MODEL = [
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--mock-data",
    "--vocab-size", "64",
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_rerun_in_a_used_save_folder_leaves_no_stale_iteration(fmt: str, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = MODEL + ["--save", str(save), "--save-interval", "2", "--ckpt-format", fmt]
    run_distributed(train_with_flags, 1, flags + ["--train-iters", "4"], timeout=180)
    assert saved_iterations(str(save)) == [2, 4] and read_tracker(str(save)) == 4
    run_distributed(train_with_flags, 1, flags + ["--train-iters", "2"], timeout=180)  # again
    assert saved_iterations(str(save)) == [2] and read_tracker(str(save)) == 2
    assert (save / "iter_0000004.superseded").is_dir()
    outputs = run_distributed(
        train_with_flags,
        1,
        flags + ["--train-iters", "3", "--load", str(save), "--override-opt_param-scheduler"],
    )
    assert "at iteration 2" in outputs[0][1]  # resumes this run's latest, not the earlier run's


def test_generation_names_the_saved_iterations_for_a_missing_ckpt_step(tmp_path) -> None:
    from megapipe.checkpointing.errors import CheckpointError
    from megapipe.inference.loading import checkpoint_directory

    for iteration in (2, 4):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    with pytest.raises(CheckpointError) as caught:
        checkpoint_directory(str(tmp_path), 7)
    assert "--ckpt-step 7" in str(caught.value)
    assert "iterations saved there: 2, 4" in str(caught.value)
    assert checkpoint_directory(str(tmp_path), 4).endswith("iter_0000004")
