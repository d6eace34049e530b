"""Megatron's stdout lines, character for character, and the log-interval averaging."""

from __future__ import annotations

import math

import pytest

from megapipe.training.interval_stats import IntervalStats
from megapipe.training.log_format import (
    iteration_line,
    parameter_count_line,
    validation_block,
    validation_line,
    world_size_line,
)

# The DESIGN.md example as Megatron-LM prints it. Its `' consumed samples: {:12d} |'` puts eleven
# spaces before "80" (real logs: "consumed samples:          128 |"); the DESIGN.md copy has ten.
MEGATRON_LINE = (
    " iteration       10/     100 | consumed samples:           80 |"
    " elapsed time per iteration (ms): 123.4 | learning rate: 1.000000E-04 |"
    " global batch size:     8 | lm loss: 1.058791E+01 | loss scale: 1.0 | grad norm: 2.345 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def test_iteration_line_is_megatrons() -> None:
    line = iteration_line(
        iteration=10,
        train_iters=100,
        consumed_samples=80,
        elapsed_ms_per_iteration=123.4,
        learning_rate=1e-4,
        global_batch_size=8,
        losses={"lm loss": 10.58791},
        loss_scale=1.0,
        grad_norm=2.345,
        skipped_iterations=0,
        nan_iterations=0,
    )
    assert line == MEGATRON_LINE


def test_iteration_line_without_grad_norm_omits_the_field() -> None:
    line = iteration_line(
        iteration=1,
        train_iters=1,
        consumed_samples=1,
        elapsed_ms_per_iteration=1.0,
        learning_rate=1.0,
        global_batch_size=1,
        losses={"lm loss": 1.0},
        loss_scale=1.0,
        grad_norm=None,
        skipped_iterations=0,
        nan_iterations=0,
    )
    assert "grad norm" not in line
    assert line.endswith("| loss scale: 1.0 | number of skipped iterations:   0 |"
                         " number of nan iterations:   0 |")  # fmt: skip


def test_startup_lines() -> None:
    assert world_size_line(8, 2, 2, 2) == (
        "using world size: 8, data-parallel size: 2, tensor-model-parallel size: 2, "
        "pipeline-model-parallel size: 2"
    )
    assert parameter_count_line(0, 1, 1234567) == (
        " > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 1234567"
    )


def test_interval_stats_average_applied_iterations_and_count_skipped() -> None:
    stats = IntervalStats()
    stats.add({"lm loss": 2.0})
    stats.add({"lm loss": float("nan")}, skipped=True)
    stats.add({"lm loss": 4.0})
    stats.add({"lm loss": 5.0}, skipped=True)
    assert stats.averages() == {"lm loss": pytest.approx(3.0)}
    assert (stats.iterations, stats.skipped_iterations, stats.nan_iterations) == (4, 2, 1)
    stats.reset()
    assert stats.averages() == {} and stats.iterations == 0 and stats.nan_iterations == 0
    stats.add({"lm loss": math.inf}, skipped=True)
    assert stats.nan_iterations == 1 and stats.averages() == {}


def _line_with(**speed) -> str:
    return iteration_line(
        iteration=10,
        train_iters=100,
        consumed_samples=80,
        elapsed_ms_per_iteration=123.4,
        learning_rate=1e-4,
        global_batch_size=8,
        losses={"lm loss": 10.58791},
        loss_scale=1.0,
        grad_norm=2.345,
        skipped_iterations=0,
        nan_iterations=0,
        **speed,
    )


def test_throughput_fields_follow_the_elapsed_time_in_megatrons_words() -> None:
    head = " elapsed time per iteration (ms): 123.4 |"
    line = _line_with(
        throughput_tflops_per_gpu=123.44, tokens_per_second_per_gpu=1234.56, mfu=0.12345
    )
    assert (
        head
        + (
            " throughput per GPU (TFLOP/s/GPU): 123.4 | tokens per second per GPU: 1234.6 |"
            " MFU: 12.3% | learning rate: 1.000000E-04 |"
        )
        in line
    )
    # without a peak (CPU) MFU is left out and nothing else moves; below 1 TFLOP/s three
    # significant digits, where Megatron's one decimal would print 0.0
    line = _line_with(throughput_tflops_per_gpu=0.0123456, tokens_per_second_per_gpu=99.0)
    assert (
        head
        + (
            " throughput per GPU (TFLOP/s/GPU): 0.0123 | tokens per second per GPU: 99.0 |"
            " learning rate:"
        )
        in line
    )
    assert "MFU" not in line
    assert _line_with() == MEGATRON_LINE  # not asked for: the line is unchanged


def test_validation_line_is_megatrons() -> None:
    # exp(1.234567) = 3.436890, and the PPL is capped at exp(20) = 4.851652E+08
    assert validation_line("iteration 10", {"lm loss": 1.234567}) == (
        " validation loss at iteration 10 | lm loss value: 1.234567E+00 |"
        " lm loss PPL: 3.436890E+00 | "
    )
    assert validation_line("iteration 3 on test set", {"lm loss": 25.0, "aux": 2.5}) == (
        " validation loss at iteration 3 on test set | lm loss value: 2.500000E+01 |"
        " lm loss PPL: 4.851652E+08 | aux value: 2.500000E+00 | aux PPL: 1.218249E+01 | "
    )


def test_validation_block_has_dash_rules_one_longer_than_the_line() -> None:
    rule, line, rule_below = validation_block("iteration 10", {"lm loss": 1.0}).split("\n")
    assert line == validation_line("iteration 10", {"lm loss": 1.0})
    assert rule == rule_below == "-" * (len(line) + 1)
