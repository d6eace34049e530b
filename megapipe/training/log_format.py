"""Megatron-LM's stdout lines, character for character: users' log parsers depend on them.

Pure string formatting; who prints what is decided in `printing.py` and `train.py`.
"""

from __future__ import annotations

from collections.abc import Mapping


def world_size_line(
    world_size: int, data_parallel: int, tensor_parallel: int, pipeline: int
) -> str:
    """The layout summary rank 0 prints at start-up."""
    return (
        f"using world size: {world_size}, data-parallel size: {data_parallel}, "
        f"tensor-model-parallel size: {tensor_parallel}, "
        f"pipeline-model-parallel size: {pipeline}"
    )


def parameter_count_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """What each model-parallel rank (of data-parallel rank 0) says about its shard."""
    return (
        " > number of parameters on (tensor, pipeline) model parallel rank "
        f"({tp_rank}, {pp_rank}): {count}"
    )


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms_per_iteration: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: float | None,
    skipped_iterations: int,
    nan_iterations: int,
) -> str:
    """Megatron's training_log line; `losses` maps names ("lm loss") to interval averages."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms_per_iteration:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_iterations:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    return line
