"""Numerical faults: a NaN/Inf loss or gradient stops every rank before the optimizer step,
naming the iteration and the rank(s) (--check-for-nan-in-loss-and-grad, on by default); fp16
overflow is still the loss scaler's to skip; --check-for-spiky-loss reports a loss far above
its running mean.

Faults are injected the way they happen: a gradient turned NaN on one rank after the data-
parallel reduction (what a bad device would do; the test wraps that rank's finish_grad_sync),
and an overflowing forward from real, huge weights. "Weights unchanged" compares every
parameter with a copy taken before the faulty iteration.
"""

from __future__ import annotations

import contextlib
import io
import math
import subprocess

import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.training.step import NonFiniteGradError, NonFiniteLossError, SpikyLossError
from megapipe.training.step_by_step import Stepper
from tests.helpers import pretrain_command, pretrain_env

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--train-iters", "8",
    "--lr", "1e-3", "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
]  # fmt: skip
POISONED = "decoder.layers.0.mlp.linear_fc1.weight"  # column-parallel: a TP shard per rank


class Trainer:
    """One rank's model, optimizer and data, stepped one iteration at a time."""

    def __init__(self, world_size: int, flags: list[str]) -> None:
        configs = parse_args(TINY + flags, world_size)
        parallel = configs.parallel
        state = ParallelState.build(
            parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        )
        self.stepper = Stepper.build(configs, state, train_samples=64)
        self.configs, self.state = configs, state
        self.chunks, self.optimizer = self.stepper.chunks, self.stepper.optimizer

    def params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for chunk in self.chunks for n, p in chunk.named_parameters()}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params().items()}

    def unchanged_since(self, before: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(p, before[n]) for n, p in self.params().items())

    def step(self):
        return self.stepper.step()

    def poison_gradient(self, name: str) -> None:
        """Make `name`'s gradient NaN on this rank once the DP reduction is done (next step)."""
        param = self.params()[name]
        buffer = param.grad_buffer
        finish = buffer.finish_grad_sync

        def poisoned() -> None:
            finish()
            param.main_grad.view(-1)[0] = float("nan")
            del buffer.finish_grad_sync  # once

        buffer.finish_grad_sync = poisoned


def _grad_fault(world_size: int, rank: int, flags: list[str]):
    trainer = Trainer(world_size, flags)
    trainer.step()
    before = trainer.snapshot()
    if rank == 1:
        trainer.poison_gradient(POISONED)
    try:
        trainer.step()
    except NonFiniteGradError as error:
        return str(error), trainer.unchanged_since(before)
    return None, trainer.unchanged_since(before)


def _inf_loss(world_size: int, flags: list[str]):
    trainer = Trainer(world_size, flags)
    trainer.step()
    with torch.no_grad():  # an output layer whose logits overflow fp32: a real Inf loss
        trainer.params()["embedding.word_embeddings.weight"].mul_(3e37)
    before = trainer.snapshot()
    try:
        trainer.step()
    except NonFiniteLossError as error:
        return str(error), trainer.unchanged_since(before)
    return None, trainer.unchanged_since(before)


def _fp16_overflow(world_size: int, rank: int, flags: list[str]):
    trainer = Trainer(world_size, ["--fp16", *flags])
    trainer.step()
    before = trainer.snapshot()
    if rank == 1:
        trainer.poison_gradient(POISONED)
    result = trainer.step()
    return result.skipped, trainer.unchanged_since(before)


def _unchecked(world_size: int, rank: int, flags: list[str]):
    trainer = Trainer(world_size, ["--no-check-for-nan-in-loss-and-grad", *flags])
    trainer.step()
    if rank == 1:
        trainer.poison_gradient(POISONED)
    return trainer.step().grad_norm


def _spike(world_size: int, flags: list[str]):
    trainer = Trainer(world_size, ["--check-for-spiky-loss", "--spiky-loss-factor", "2", *flags])
    losses = [trainer.step().lm_loss for _ in range(3)]
    with torch.no_grad():  # a sharper output layer: the loss jumps far above ln(vocab)
        trainer.params()["embedding.word_embeddings.weight"].mul_(300)
    before, err = trainer.snapshot(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            loss = trainer.step().lm_loss
        return losses, loss, trainer.unchanged_since(before), err.getvalue()
    except SpikyLossError as error:
        return losses, str(error), trainer.unchanged_since(before), err.getvalue()


TP2 = ["--tensor-model-parallel-size", "2"]


def _scenarios(rank: int, world_size: int) -> dict:
    """Every two-rank scenario in one pair of processes (one start-up for the module)."""
    return {
        "grad tp2": _grad_fault(world_size, rank, TP2),
        "grad dp2 distributed optimizer": _grad_fault(
            world_size, rank, ["--use-distributed-optimizer"]
        ),
        "inf loss tp2": _inf_loss(world_size, TP2),
        "fp16 tp2": _fp16_overflow(world_size, rank, TP2),
        "unchecked tp2": _unchecked(world_size, rank, TP2),
        "spike warns": _spike(world_size, TP2),
        "spike stops": _spike(world_size, [*TP2, "--exit-on-spiky-loss"]),
    }


@pytest.fixture(scope="module")
def scenarios() -> list[dict]:
    return run_distributed(_scenarios, 2)


@pytest.mark.parametrize("layout", ["grad tp2", "grad dp2 distributed optimizer"])
def test_nan_gradient_on_one_rank_stops_every_rank_with_iteration_and_rank(scenarios, layout):
    for rank, found in enumerate(scenarios):
        message, unchanged = found[layout]
        assert message is not None, f"rank {rank} did not stop"
        assert message.startswith(f"iteration 2: gradient norm is nan on rank {rank}; ")
        assert "NaN/Inf gradients on rank(s) 1 " in message, message
        assert (POISONED in message) == (rank == 1), message
        assert message.endswith("the weights are those of the previous iteration")
        assert unchanged, f"rank {rank}: the optimizer step changed the weights"


def test_non_finite_loss_at_tp2_stops_every_rank_before_the_step(scenarios):
    for rank, found in enumerate(scenarios):
        message, unchanged = found["inf loss tp2"]
        assert message is not None, f"rank {rank} did not stop"
        loss = message.split("lm loss is ")[1].split(" ")[0]
        assert message.startswith("iteration 2: lm loss is ") and not math.isfinite(float(loss))
        assert f" on rank {rank}; stopping before the optimizer step" in message
        assert unchanged


def test_fp16_overflow_is_still_skipped_not_stopped(scenarios):
    assert [found["fp16 tp2"] for found in scenarios] == [(True, True), (True, True)]


def test_no_check_flag_trains_on_through_a_nan_gradient(scenarios):
    norms = [found["unchecked tp2"] for found in scenarios]
    assert all(math.isnan(n) for n in norms), norms


def test_spiky_loss_warns_by_default_and_stops_with_exit_on_spiky_loss(scenarios):
    for rank, found in enumerate(scenarios):
        losses, loss, unchanged, err = found["spike warns"]
        assert loss > 2 * max(losses) and not unchanged  # trained on
        assert err.startswith("warning: iteration 4: lm loss ") == (rank == 0), err  # once
        losses, message, unchanged, _ = found["spike stops"]
        mean = sum(losses) / 3
        assert message.startswith("iteration 4: lm loss ") and unchanged, message
        assert f"the mean {mean:.6E} of the previous 3 iterations" in message, (message, mean)


@pytest.mark.slow
def test_cli_exits_non_zero_with_one_line_on_every_rank():
    run = subprocess.run(
        pretrain_command(
            2, [*TINY, "--tensor-model-parallel-size", "2", "--init-method-std", "1e25"]
        ),
        capture_output=True,
        text=True,
        timeout=180,
        env=pretrain_env(),
    )
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert sorted(lines) == [
        f"pretrain_gpt.py: error: iteration 1: lm loss is nan on rank {rank}; stopping before "
        "the optimizer step, so the weights are those of the previous iteration"
        for rank in (0, 1)
    ], run.stderr
