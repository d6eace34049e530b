"""The training loop in-process on forked gloo ranks: layouts the CLI tests do not launch.

Each layout trains the same tiny GPT on the same mock global batches and must report the same
per-iteration loss and grad norm as one rank does (fp32 rounding apart).
"""

from __future__ import annotations

import pytest
import torch._dynamo  # noqa: F401  (see below)

from megapipe.testing import run_distributed, train_with_flags

# torch.optim.Optimizer.__init__ imports torch._dynamo on first use (seconds of CPU); importing it
# here, once, lets every forked rank inherit it instead of paying for it again.

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "256",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "2",
]  # fmt: skip


def _train(rank: int, world_size: int, extra: list[str]) -> tuple[list[float], list[float], str]:
    results, out = train_with_flags(rank, world_size, TINY + extra)
    return [r.lm_loss for r in results], [r.grad_norm for r in results], out


def _single(extra: list[str]) -> tuple[list[float], list[float], str]:
    return run_distributed(_train, 1, extra, timeout=120)[0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float], str]:
    return _single([])


@pytest.fixture(scope="module")
def data_parallel() -> list[tuple[list[float], list[float], str]]:
    """DP=2: two micro-batches of the global batch of 8 per rank, where one rank runs four."""
    return run_distributed(_train, 2, [], timeout=120)


def _assert_matches(results, losses: list[float], norms: list[float]) -> None:
    for rank_losses, rank_norms, _ in results:  # every rank reports the global values
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        assert rank_norms == pytest.approx(norms, rel=1e-4)


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "2"],
    ],
    ids=["tp2-sp", "tp2-gqa"],
)
def test_tensor_parallel_layouts_match_one_rank(reference, extra: list[str]) -> None:
    gqa = "--group-query-attention" in extra
    losses, norms, _ = reference if not gqa else _single(extra[2:])
    if gqa:
        assert losses != pytest.approx(reference[0], rel=1e-5)  # GQA really changed the model
    _assert_matches(run_distributed(_train, 2, extra, timeout=120), losses, norms)


def test_gradient_accumulation_over_data_parallel_matches_one_rank(
    reference, data_parallel
) -> None:
    losses, norms, _ = reference
    _assert_matches(data_parallel, losses, norms)


def test_log_interval_averages_losses_and_only_the_last_rank_prints(
    reference, data_parallel
) -> None:
    losses, _, single_out = reference
    logged = [float(line.split("lm loss: ")[1].split(" ")[0]) for line in single_out.splitlines()
              if line.startswith(" iteration")]  # fmt: skip
    # --log-interval 2 over 4 iterations: two lines, each the mean of its two iterations.
    expected = [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2]
    assert logged == pytest.approx(expected, rel=1e-6)
    first, last = (out for _, _, out in data_parallel)
    assert "\n iteration " not in "\n" + first
    logs = [line[:12] for line in last.splitlines() if not line.startswith("[Rank ")]
    assert logs == [" iteration  "] * 2


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]),
        (
            4,
            [
                "--pipeline-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
        ),
        (4, ["--pipeline-model-parallel-size", "2"]),  # and DP=2
    ],
    ids=["pp2-1f1b", "pp2-gpipe", "tp2-pp2-sp", "pp2-dp2"],
)
def test_pipeline_layouts_match_one_rank(reference, world: int, extra: list[str]) -> None:
    _assert_matches(run_distributed(_train, world, extra, timeout=120), *reference[:2])


def test_interleaved_pipeline_matches_one_rank() -> None:
    four_layers = ["--num-layers", "4"]
    losses, norms, _ = _single(four_layers)
    interleaved = four_layers + [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ]
    results = run_distributed(_train, 2, interleaved, timeout=120)
    _assert_matches(results, losses, norms)
    assert "pipeline layer map" in results[0][2]  # rank 0 printed which layers each chunk owns


def test_learning_rate_schedule_reaches_the_optimizer_and_the_log() -> None:
    flags = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
             "--log-interval", "1"]  # fmt: skip
    results, out = run_distributed(train_with_flags, 1, TINY + flags)[0]
    logged = [float(line.split("learning rate: ")[1].split(" ")[0])
              for line in out.splitlines() if line.startswith(" iteration")]  # fmt: skip
    peak, low = 3e-3, 1e-4  # warmup to --lr over 2 iterations, then half a cosine to --min-lr
    assert logged == pytest.approx([peak / 2, peak, (peak + low) / 2, low], rel=1e-6)
    frozen = run_distributed(train_with_flags, 1, TINY + ["--lr", "0"])[0][0]
    # Megatron's first warmup step uses lr 0: the second iteration still sees the initial weights
    assert results[1].lm_loss == pytest.approx(frozen[1].lm_loss, rel=1e-6)
    assert results[2].lm_loss != pytest.approx(frozen[2].lm_loss, rel=1e-6)
