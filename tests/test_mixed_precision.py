"""bf16/fp16 training tracks fp32; the fp16 loss scaler skips, backs off and recovers; NaN stops.

Tolerances: the loss of a bf16 (fp16) run must stay within 5e-3 (1e-3) relative of the fp32
run over 8 iterations. bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 2e-3 per value),
fp16 keeps 11 (5e-4); the loss is a mean over many tokens, so its error stays near one rounding
step (measured: ~2e-5 for both). A missing unscale, a wrong master-weight copy or bf16 gradient
accumulation moves the loss by far more within a few Adam steps.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)

from megapipe.arguments import parse_args
from megapipe.parallel import ParallelState
from megapipe.testing import run_distributed, train_with_flags
from megapipe.training.step import NonFiniteLossError

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "128",
    "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1",
]  # fmt: skip


def _train(rank: int, world: int, extra: list[str]):
    results, out = train_with_flags(rank, world, TINY + extra)
    return [r.lm_loss for r in results], [r.skipped for r in results], out


@pytest.fixture(scope="module")
def fp32():
    return run_distributed(_train, 1, [])[0]


@pytest.mark.parametrize("flag,tolerance", [("--bf16", 5e-3), ("--fp16", 1e-3)])
def test_half_precision_tracks_fp32(fp32, flag, tolerance):
    extra = [flag] + (["--initial-loss-scale", "4096"] if flag == "--fp16" else [])
    losses, skipped, _ = run_distributed(_train, 1, extra)[0]
    assert not any(skipped)
    assert losses == pytest.approx(fp32[0], rel=tolerance)
    assert losses != fp32[0]  # the run really computed in half precision


def test_fp16_overflow_skips_backs_off_and_recovers(fp32):
    frozen = run_distributed(_train, 1, ["--lr", "0"])[0][0]  # the initial weights' losses
    losses, skipped, out = run_distributed(
        _train, 1, ["--fp16", "--initial-loss-scale", str(2.0**24)]
    )[0]
    k = skipped.index(False)
    assert k >= 2 and not any(skipped[k:])  # hysteresis 2: the first overflow only counts
    assert losses[: k + 1] == pytest.approx(frozen[: k + 1], rel=1e-3)  # skipped: weights untouched
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    scales = [float(re.search(r"loss scale: ([\d.]+)", line).group(1)) for line in lines]
    skips = [int(re.search(r"skipped iterations: +(\d+)", line).group(1)) for line in lines]
    # Megatron's scaler, written out: no back-off at the first overflow, halve at each next one
    expected = (
        [2.0**24]
        + [2.0**24 / 2**i for i in range(1, k)]
        + [2.0**24 / 2 ** (k - 1)] * (len(lines) - k)
    )
    assert scales == expected
    assert skips == [1] * k + [0] * (len(lines) - k)


def test_bytes_per_parameter_match_megatrons_table():
    from megapipe.training.build import build_model_chunks_for, build_optimizer

    def measure(rank, world, extra):
        configs = parse_args(TINY + ["--bf16", "--global-batch-size", "8"] + extra, world)
        state = ParallelState.build()
        optimizer = build_optimizer(build_model_chunks_for(configs, state), configs, state)
        for buffer in optimizer.buffers:  # one step so that Adam allocates its state
            for p in buffer.params:
                p.main_grad.fill_(1e-3)
        optimizer.step(1e-3)
        return optimizer.state_bytes_per_parameter()

    plain = run_distributed(measure, 1, [])[0]
    assert plain == pytest.approx({"params": 2, "grads": 4, "master": 4, "optimizer": 8})
    for d in (2, 4):
        for sharded in run_distributed(measure, d, ["--use-distributed-optimizer"]):
            assert sum(sharded.values()) == pytest.approx(6 + 12 / d, rel=0.02)  # padding


def _nan(rank, world, extra):
    try:
        _train(rank, world, extra)
    except NonFiniteLossError as error:
        return str(error)
    return None


@pytest.mark.parametrize("flag", [[], ["--bf16"]])
def test_nan_loss_stops_training_with_the_iteration(flag):
    message = run_distributed(_nan, 1, ["--init-method-std", "1e25"] + flag)[0]
    assert message is not None and message.startswith("iteration 1: lm loss is nan")


@pytest.mark.slow
def test_nan_loss_exits_non_zero_with_one_line(tmp_path: Path):
    script = Path(__file__).resolve().parent.parent / "pretrain_gpt.py"
    run = subprocess.run(
        [sys.executable, str(script), *TINY, "--init-method-std", "1e25"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert errors == [
        "pretrain_gpt.py: error: iteration 1: lm loss is nan on rank 0; stopping before "
        "the optimizer step, so the weights are those of the previous iteration"
    ]


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_over_the_world_group():
    from megapipe.distributed import loss_scaler
    from megapipe.training.build import build_model_chunks_for, build_optimizer

    def step(rank, world, extra):
        configs = parse_args(TINY + ["--fp16"] + extra, world)
        state = ParallelState.build()
        optimizer = build_optimizer(build_model_chunks_for(configs, state), configs, state)
        params = [p for buffer in optimizer.buffers for p in buffer.params]
        before = [p.detach().clone() for p in params]
        for p in params:
            p.main_grad.fill_(1e-3)
        if rank == 1:  # inside this rank's own shard (what it checks) also when sharded
            optimizer.masters[0].grad[0] = float("inf")
        groups, real = [], loss_scaler.dist.all_reduce
        loss_scaler.dist.all_reduce = lambda t, **kw: groups.append(kw["group"]) or real(t, **kw)
        outcome = optimizer.step(1e-3)
        loss_scaler.dist.all_reduce = real
        unchanged = all(torch.equal(p, b) for p, b in zip(params, before))
        return outcome.skipped, unchanged, groups == [state.world.pg], state.world.ranks

    for extra in ([], ["--use-distributed-optimizer"]):
        for skipped, unchanged, over_world, ranks in run_distributed(step, 2, extra):
            assert (skipped, unchanged, over_world, ranks) == (True, True, True, (0, 1))
