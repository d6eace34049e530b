"""TensorBoard output read back with tensorboard's own EventAccumulator; the writing rank."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from megapipe.parallel.state import Group, ParallelState, rank_layout
from megapipe.testing import run_distributed
from megapipe.training.tensorboard_log import TrainingTensorBoard


def _read(log_dir) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _series(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_train_scalars_follow_megatrons_names_steps_and_interval(tmp_path) -> None:
    consumed = {1: 4, 2: 12, 3: 24, 4: 40}  # a batch-size ramp: 4, 8, 12, 16 samples
    with TrainingTensorBoard(str(tmp_path), log_interval=2) as board:
        for it in range(1, 5):
            board.log_train(
                it,
                consumed[it],
                losses={"lm loss": 10.0 - it},
                learning_rate=1e-4 * it,
                grad_norm=None if it == 4 else 0.5 * it,  # None is skipped, not written as 0
                loss_scale=2.0**16,
                batch_size=4 * it,
                iteration_time_s=0.25 * it if it % 2 == 0 else None,
                throughput_tflops=1.5 if it % 2 == 0 else None,
                timers={"forward-backward": 0.125} if it % 2 == 0 else None,
            )
    events = _read(tmp_path)
    paired = ["lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size"]
    single = ["iteration-time", "throughput", "forward-backward-time"]
    expected_tags = set(single) | set(paired) | {f"{t} vs samples" for t in paired}
    assert set(events.Tags()["scalars"]) == expected_tags

    # interval scalars only at iterations 2 and 4; "vs samples" stepped by consumed samples
    assert _series(events, "lm loss") == [(2, 8.0), (4, 6.0)]
    assert _series(events, "lm loss vs samples") == [(12, 8.0), (40, 6.0)]
    assert [s for s, _ in _series(events, "learning-rate vs samples")] == [12, 40]
    assert [v for _, v in _series(events, "learning-rate")] == pytest.approx([2e-4, 4e-4])
    assert _series(events, "batch-size") == [(2, 8.0), (4, 16.0)]
    assert _series(events, "batch-size vs samples") == [(12, 8.0), (40, 16.0)]
    assert _series(events, "grad-norm") == [(2, 1.0)]
    assert _series(events, "loss-scale vs samples") == [(12, 65536.0), (40, 65536.0)]
    # timing scalars: by iteration only
    assert _series(events, "iteration-time") == [(2, 0.5), (4, 1.0)]
    assert _series(events, "throughput") == [(2, 1.5), (4, 1.5)]
    assert _series(events, "forward-backward-time") == [(2, 0.125), (4, 0.125)]


def test_validation_scalars_and_capped_perplexity(tmp_path) -> None:
    board = TrainingTensorBoard(str(tmp_path))
    board.log_validation(10, 80, {"lm loss": 2.0})
    board.log_validation(20, 160, {"lm loss": 30.0})  # ppl capped at exp(20)
    board.close()
    events = _read(tmp_path)
    assert set(events.Tags()["scalars"]) == {
        "lm loss validation",
        "lm loss validation vs samples",
        "lm loss validation ppl",
        "lm loss validation ppl vs samples",
    }
    assert _series(events, "lm loss validation") == [(10, 2.0), (20, 30.0)]
    assert [s for s, _ in _series(events, "lm loss validation vs samples")] == [80, 160]
    ppl = _series(events, "lm loss validation ppl vs samples")
    assert [s for s, _ in ppl] == [80, 160]
    assert [v for _, v in ppl] == pytest.approx([7.389056, 4.851652e8], rel=1e-6)


def test_validation_perplexity_can_be_left_out(tmp_path) -> None:
    with TrainingTensorBoard(str(tmp_path), log_validation_ppl=False) as board:
        board.log_validation(10, 80, {"lm loss": 2.0})
    assert set(_read(tmp_path).Tags()["scalars"]) == {
        "lm loss validation",
        "lm loss validation vs samples",
    }


def test_arguments_are_one_text_entry_each(tmp_path) -> None:
    with TrainingTensorBoard(str(tmp_path)) as board:
        board.log_arguments({"seq_length": 128, "fp16": True, "data_path": ["0.3", "A"]}, step=5)
    events = _read(tmp_path)
    texts = {}
    for tag in events.Tags()["tensors"]:
        (event,) = events.Tensors(tag)
        assert event.step == 5
        texts[tag] = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    assert texts == {
        "seq_length/text_summary": "128",
        "fp16/text_summary": "True",
        "data_path/text_summary": "['0.3', 'A']",
    }


def test_bad_interval_and_queue_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="--tensorboard-log-interval must be positive, got 0"):
        TrainingTensorBoard(str(tmp_path), log_interval=0)
    with pytest.raises(ValueError, match="--tensorboard-queue-size must be positive, got -1"):
        TrainingTensorBoard(str(tmp_path), queue_size=-1)


def _state_of(rank: int, world: int, tp: int, pp: int) -> ParallelState:
    """This rank's ParallelState from the pure layout (no process groups needed)."""
    layout = rank_layout(world, tp, pp)
    mine = {}
    for kind, groups in layout.items():
        mine[kind] = next((Group(tuple(g), g.index(rank)) for g in groups if rank in g), None)
    return ParallelState(world, rank, device=torch.device("cpu"), **mine)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "writer"),
    # rank = tp_rank + tp * (dp_rank + dp * pp_rank) with tp_rank = dp_rank = 0, last pp stage
    [(1, 1, 1, 0), (8, 2, 2, 4), (8, 1, 8, 7), (8, 8, 1, 0), (8, 2, 4, 6), (8, 1, 1, 0)],
)
def test_exactly_one_rank_writes(world, tp, pp, writer) -> None:
    chosen = [r for r in range(world) if TrainingTensorBoard.writes_on(_state_of(r, world, tp, pp))]
    assert chosen == [writer]


def _writes_on_real_state(rank: int, world_size: int) -> tuple[bool, int, int, int]:
    state = ParallelState.build(2, 2)
    return TrainingTensorBoard.writes_on(state), state.tp_rank, state.dp_rank, state.pp_rank


def test_exactly_one_rank_writes_on_a_real_tp2_pp2_dp2_world() -> None:
    results = run_distributed(_writes_on_real_state, 8)
    writers = [(rank, coords) for rank, (writes, *coords) in enumerate(results) if writes]
    assert writers == [(4, [0, 0, 1])]  # tp 0, dp 0, pp 1 (the last stage)


def test_open_for_gives_a_writer_only_on_the_writing_rank(tmp_path) -> None:
    assert TrainingTensorBoard.open_for(_state_of(0, 8, 2, 2), str(tmp_path)) is None
    assert TrainingTensorBoard.open_for(_state_of(4, 8, 2, 2), None) is None
    board = TrainingTensorBoard.open_for(_state_of(4, 8, 2, 2), str(tmp_path), log_interval=3)
    assert isinstance(board, TrainingTensorBoard) and board.log_interval == 3
    board.close()
