"""Evaluation on the validation and test splits: Megatron's lines, the right samples, the same
losses whatever the layout, an independent plain-PyTorch reference, and no effect on training."""

from __future__ import annotations

import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.data.mock import MockGPTDataset
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags
from megapipe.testing.reference_gpt import reference_from_megapipe
from megapipe.training.build import build_model_chunks_for
from tests.helpers import validation_lines

GBS, MBS, SEQ, VOCAB = 8, 2, 16, 128
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--mock-data", "--vocab-size", str(VOCAB),
    "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-iters", "4",
    "--lr", "3e-3", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "2",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _run(world: int, extra: list[str]) -> tuple[list, str]:
    outputs = run_distributed(train_with_flags, world, BASE + extra)
    results = outputs[0][0]
    return results, outputs[-1][1]  # the last rank prints Megatron's lines


@pytest.fixture(scope="module")
def single() -> tuple[list, str]:
    return _run(1, [])


def test_validation_every_interval_then_validation_and_test_at_the_end(single) -> None:
    lines = validation_lines(single[1])
    prefixes = [prefix for prefix, _, _ in lines]
    assert prefixes == [
        "iteration 2",
        "iteration 4",
        "iteration 4 on validation set",
        "iteration 4 on test set",
    ]
    for _, loss, ppl in lines:
        assert ppl == pytest.approx(float(f"{torch.tensor(loss).exp().item():.6E}"), rel=1e-6)
    # successive validations read new samples: the two evaluations at iteration 4 differ
    assert lines[1][1] != lines[2][1]


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (4, ["--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1"]),
        (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--use-distributed-optimizer"]),
    ],
    ids=["tp2-sp", "pp2", "pp2-interleaved-dp2", "tp2-pp2-dp2"],
)  # fmt: skip
def test_validation_losses_match_the_single_rank_run(single, world, layout) -> None:
    results, stdout = _run(world, layout)
    expected = validation_lines(single[1])
    got = validation_lines(stdout)
    assert [p for p, _, _ in got] == [p for p, _, _ in expected]
    for (_, loss, _), (_, ref, _) in zip(got, expected):
        assert loss == pytest.approx(ref, rel=2e-6)  # printed with 7 significant digits
    assert [r.lm_loss for r in results] == pytest.approx([r.lm_loss for r in single[0]], rel=1e-5)


def test_evaluation_leaves_training_untouched() -> None:
    """Same losses and grad norms with and without evaluation, dropout on (no RNG is drawn,
    no gradient or optimizer state is touched by evaluating)."""
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    with_eval, _ = _run(2, ["--pipeline-model-parallel-size", "2", *dropout])
    without, stdout = _run(
        2, ["--pipeline-model-parallel-size", "2", *dropout, "--eval-iters", "0"]
    )
    assert validation_lines(stdout) == []
    assert [(r.lm_loss, r.grad_norm) for r in with_eval] == [
        (r.lm_loss, r.grad_norm) for r in without
    ]


def _plain_losses(split: str, batches: int) -> float:
    """The untrained model's mean loss over the first `batches` global batches of `split`,
    computed by the plain-PyTorch reference GPT on the mock samples."""
    configs = parse_args(BASE + ["--skip-train"], 1)
    (model,) = build_model_chunks_for(configs, ParallelState.single())
    plain = reference_from_megapipe(model).eval()
    data = MockGPTDataset(VOCAB, SEQ, configs.training.seed, split=split)
    losses = []
    with torch.no_grad():
        for start in range(0, batches * GBS, MBS):
            batch = data.batch(range(start, start + MBS))
            losses.append(plain(batch.tokens, batch.labels).mean())
    return float(torch.stack(losses).mean())


def test_skip_train_evaluates_the_initial_model_as_plain_pytorch_does() -> None:
    results, stdout = _run(1, ["--skip-train"])
    assert results == []
    lines = validation_lines(stdout)
    assert [p for p, _, _ in lines] == ["iteration 0 on validation set", "iteration 0 on test set"]
    assert lines[0][1] == pytest.approx(_plain_losses("valid", 2), rel=2e-6)
    assert lines[1][1] == pytest.approx(_plain_losses("test", 2), rel=2e-6)
    assert lines[0][1] != lines[1][1]


def test_a_split_with_no_share_is_not_evaluated() -> None:
    _, stdout = _run(1, ["--split", "98,2,0"])
    assert [p for p, _, _ in validation_lines(stdout)][-1] == "iteration 4 on validation set"
