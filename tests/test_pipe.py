"""megapipe.pipeline.Pipe pipelines a plain nn.Sequential (not a GPT) over 2 and 4 ranks.

The reference is the same model unpipelined, in plain PyTorch: the mean over micro-batches of
the loss of each micro-batch, backpropagated once. Every rank's gradients (named as in the
unpipelined model) and the last stage's loss must equal it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from megapipe.errors import ConfigError
from megapipe.pipeline.pipe import Pipe, contiguous_split
from megapipe.testing import run_distributed

BATCH, CHUNKS = 8, 4
EXAMPLE = Path(__file__).parent.parent / "examples" / "pipe_sequential.py"


def make_model() -> nn.Sequential:
    """Boundaries of different widths, so each transfer has its own shape."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.Tanh(),
        nn.Linear(32, 24),
        nn.LayerNorm(24),
        nn.GELU(),
        nn.Linear(24, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 12, generator=generator)
    y = torch.randint(0, 5, (BATCH,), generator=generator)
    return x, y


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = make_model()
    x, y = make_batch()
    losses = [
        nn.functional.cross_entropy(model(xi), yi)
        for xi, yi in zip(x.chunk(CHUNKS), y.chunk(CHUNKS))
    ]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _pipe_rank(rank: int, world_size: int, schedule: str, balance, v: int) -> dict:
    x, y = make_batch()
    pipe = Pipe(
        make_model(),
        chunks=CHUNKS,
        sample_input=x,
        loss_fn=nn.functional.cross_entropy,
        balance=balance,
        schedule=schedule,
        virtual_stages=v,
    )
    losses = []
    for _ in range(2):  # a second step accumulates: gradients twice the first step's
        loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None)
        losses.append(None if loss is None else loss.item())
    grads = {name: p.grad / 2 for name, p in pipe.named_parameters().items()}
    return {"losses": losses, "grads": grads, "balance": pipe.balance}


CASES = [
    (2, "1f1b", "uniform", 1),
    (4, "1f1b", [2, 2, 3, 1], 1),
    (2, "gpipe", "time", 1),
    (4, "1f1b", "memory", 1),
    (2, "interleaved-1f1b", "uniform", 2),
]


@pytest.mark.parametrize(("world", "schedule", "balance", "v"), CASES)
def test_pipe_matches_the_unpipelined_model(world, schedule, balance, v) -> None:
    loss, grads = reference()
    results = run_distributed(_pipe_rank, world, schedule, balance, v)
    assert results[-1]["losses"] == pytest.approx([loss, loss], rel=1e-6)
    assert all(r["losses"] == [None, None] for r in results[:-1])
    assert len({tuple(r["balance"]) for r in results}) == 1  # every rank cut the same way
    seen: dict[str, torch.Tensor] = {}
    for result in results:
        assert not set(result["grads"]) & set(seen), "a parameter lives on two ranks"
        seen.update(result["grads"])
    assert set(seen) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(seen[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_memory_balance_follows_the_heavy_module() -> None:
    assert contiguous_split([1, 1, 1, 1], 2) == [2, 2]
    assert contiguous_split([8, 1, 1, 1, 1], 2) == [1, 4]
    assert contiguous_split([1, 1, 1, 9, 1, 1], 3) == [3, 1, 2]


def test_bad_arguments_are_named() -> None:
    x, _ = make_batch()
    with pytest.raises(ConfigError, match="multiple of chunks"):
        Pipe(make_model(), chunks=3, sample_input=x, loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ConfigError, match="schedule"):
        Pipe(make_model(), chunks=4, sample_input=x, loss_fn=nn.functional.cross_entropy,
             schedule="zero-bubble-h1")  # fmt: skip
    with pytest.raises(ConfigError, match="balance"):
        Pipe(make_model(), chunks=4, sample_input=x, loss_fn=nn.functional.cross_entropy,
             balance=[3, 5])  # fmt: skip
    with pytest.raises(ConfigError, match="cannot split"):
        contiguous_split([1.0], 2)


def _one_stage(rank: int, world_size: int) -> float:
    x, y = make_batch()
    pipe = Pipe(make_model(), chunks=CHUNKS, sample_input=x, loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ConfigError, match="sample's shape"):
        pipe.step(x[:4], y)
    return pipe.step(x, y).item()


def test_one_rank_is_plain_accumulation() -> None:
    loss, _ = reference()
    assert run_distributed(_one_stage, 1)[0] == pytest.approx(loss, rel=1e-6)


def _run_example(rank: int, world_size: int, argv: list[str]) -> str:
    spec = importlib.util.spec_from_file_location("pipe_sequential", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main(argv)
    return out.getvalue()


def test_the_example_trains_a_convnet_like_the_unpipelined_run() -> None:
    """examples/pipe_sequential.py on 2 ranks: losses fall and equal the unpipelined run's."""
    stdout = run_distributed(_run_example, 2, ["--steps", "12"])[-1]
    losses = [float(line.split("loss")[1]) for line in stdout.splitlines() if "| loss" in line]
    assert len(losses) == 12 and losses[-1] < losses[0]
    worst = re.search(r"largest difference from the unpipelined run: (\S+)", stdout)
    assert worst is not None and float(worst.group(1)) < 1e-5
