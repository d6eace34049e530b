"""Megatron-LM's stdout lines, character for character: users' log parsers depend on them.

Pure string formatting; who prints what is decided in `printing.py` and `train.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def world_size_line(
    world_size: int,
    data_parallel: int,
    tensor_parallel: int,
    pipeline: int,
    context_parallel: int = 1,
) -> str:
    """The layout summary rank 0 prints at start-up (the context-parallel size, where Megatron
    prints it, only when above 1: the line of a run without CP stays as parsers know it)."""
    context = f"context-parallel size: {context_parallel}, " if context_parallel > 1 else ""
    return (
        f"using world size: {world_size}, data-parallel size: {data_parallel}, {context}"
        f"tensor-model-parallel size: {tensor_parallel}, "
        f"pipeline-model-parallel size: {pipeline}"
    )


def parameter_count_line(
    tp_rank: int,
    pp_rank: int,
    count: int,
    experts: tuple[int, int, int, int] | None = None,
) -> str:
    """What each model-parallel rank (of data-parallel rank 0) says about its shard.

    experts (expert parallelism): (EP rank, EP size, this rank's expert parameters, its
    experts per MoE layer out of the layer's): each EP rank says its share."""
    line = (
        " > number of parameters on (tensor, pipeline) model parallel rank "
        f"({tp_rank}, {pp_rank}): {count}"
    )
    if experts is None:
        return line
    ep_rank, ep_size, expert_count, local = experts
    return (
        f"{line} on expert parallel rank {ep_rank} of {ep_size}, of which {expert_count} in "
        f"its {local} experts per MoE layer ({local * ep_size} in all)"
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
    throughput_tflops_per_gpu: float | None = None,
    tokens_per_second_per_gpu: float | None = None,
    mfu: float | None = None,
    num_zeros: float | None = None,
    params_norm: float | None = None,
) -> str:
    """Megatron's training_log line; `losses` maps names ("lm loss") to interval averages.

    The speed fields (--log-throughput) follow the elapsed time, each printed only when given:
    Megatron's `throughput per GPU (TFLOP/s/GPU)`, then megapipe's tokens per second per GPU
    and MFU (a fraction, printed as a percentage; None without a known peak).
    `flops.Throughput`'s fields have these names: `iteration_line(..., **asdict(t))`.
    `num_zeros` (--log-num-zeros-in-grad) and `params_norm` (--log-params-norm) follow the
    grad norm, in Megatron's order, when given.
    """
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms_per_iteration:.1f} |"
    if throughput_tflops_per_gpu is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {_tflops(throughput_tflops_per_gpu)} |"
    if tokens_per_second_per_gpu is not None:
        line += f" tokens per second per GPU: {tokens_per_second_per_gpu:.1f} |"
    if mfu is not None:
        line += f" MFU: {100 * mfu:.1f}% |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros:.1f} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_iterations:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    return line


def perplexity(loss: float) -> float:
    """Megatron's PPL: exp of the loss, capped at exp(20) so a diverged run prints a number."""
    return math.exp(min(20.0, loss))


def validation_line(prefix: str, losses: Mapping[str, float]) -> str:
    """Megatron's evaluation result: ` validation loss at {prefix} | lm loss value: ... | `.

    prefix is `iteration N` during training, `iteration N on validation set` and
    `iteration N on test set` at the end. PPL is exp(min(20, loss)), as Megatron caps it.
    """
    line = f" validation loss at {prefix} | "
    for name, value in losses.items():
        line += f"{name} value: {value:.6E} | "
        line += f"{name} PPL: {perplexity(value):.6E} | "
    return line


def validation_block(prefix: str, losses: Mapping[str, float]) -> str:
    """The validation line between two rules of dashes one longer than it, as Megatron prints."""
    line = validation_line(prefix, losses)
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def _tflops(value: float) -> str:
    """Megatron's one decimal, but three significant digits below 1 TFLOP/s (CPU runs), where
    one decimal would print 0.0."""
    return f"{value:.1f}" if value >= 1.0 else f"{value:.3g}"
