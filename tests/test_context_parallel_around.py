"""Context parallelism around training: evaluation, and generation from what it trained.

- the validation losses a CP run logs (`--eval-interval`, `--eval-iters`: every CP rank reads
  the same samples and keeps its two chunks, the loss is the whole sequences' mean) are the
  one-rank run's, at CP2 with p2p and a2a and at CP2 x PP2 (fp32, rope);
- a checkpoint trained at CP2 generates, at 1 rank and at TP2, the greedy tokens (and the
  logits) of the one-rank run's checkpoint of the same iteration (checkpoints are layout-free);
- the generation tool refuses `--context-parallel-size 2` in one line naming the flag
  (generation runs without CP), and takes `1` as a no-op.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megapipe.inference.generation import full_logits, generate
from megapipe.inference.loading import load_inference_model
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags
from tests.helpers import PARITY_FLAGS, load_tool, run, validation_lines

TOLERANCE = 1e-5
CP2 = ["--context-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2", "--emulate-nccl-p2p-order"]
ROPE = ["--position-embedding-type", "rope"]
EVAL_ITERS = PARITY_FLAGS.index("--eval-iters") + 1  # PARITY_FLAGS evaluate nothing: 2 here
EVALUATED = [*PARITY_FLAGS[:EVAL_ITERS], "2", *PARITY_FLAGS[EVAL_ITERS + 1 :]]
EVALUATED += ["--eval-interval", "2", *ROPE]
EVAL_LAYOUTS = {
    "cp2-p2p": (2, CP2 + ["--cp-comm-type", "p2p"]),
    "cp2-a2a": (2, CP2 + ["--cp-comm-type", "a2a"]),
    "cp2-pp2": (4, CP2 + PP2),
}


def _evaluated(world: int, extra: list[str]) -> tuple[list[float], list[tuple[str, float]]]:
    """Training losses (first rank) and the validation lines (last rank prints them)."""
    outputs = run_distributed(train_with_flags, world, EVALUATED + extra, timeout=180)
    lines = validation_lines(outputs[-1][1])
    return [r.lm_loss for r in outputs[0][0]], [(where, loss) for where, loss, _ in lines]


@pytest.fixture(scope="module")
def one_rank_evaluation() -> tuple[list[float], list[tuple[str, float]]]:
    return _evaluated(1, [])


def test_the_one_rank_run_evaluates_what_the_comparison_needs(one_rank_evaluation) -> None:
    """The reference logs 4 distinct validation losses (the model moves between them)."""
    _, lines = one_rank_evaluation
    assert [where for where, _ in lines] == [
        "iteration 2",
        "iteration 4",
        "iteration 4 on validation set",
        "iteration 4 on test set",
    ]
    assert len({loss for _, loss in lines}) == 4


@pytest.mark.parametrize("layout", list(EVAL_LAYOUTS))
def test_validation_losses_under_context_parallelism_match_one_rank(
    one_rank_evaluation, layout: str
) -> None:
    world, extra = EVAL_LAYOUTS[layout]
    losses, lines = _evaluated(world, extra)
    expected_losses, expected_lines = one_rank_evaluation
    assert [where for where, _ in lines] == [where for where, _ in expected_lines]
    for (where, loss), (_, expected) in zip(lines, expected_lines):
        assert loss == pytest.approx(expected, rel=TOLERANCE), where  # printed to 7 digits
    assert losses == pytest.approx(expected_losses, rel=TOLERANCE)


# --- generation from a checkpoint trained under CP ----------------------------------------------

TRAIN_ITERS = PARITY_FLAGS.index("--train-iters") + 1  # 16 iterations: greedy starts to count
TRAIN = [*PARITY_FLAGS[:TRAIN_ITERS], "16", *PARITY_FLAGS[TRAIN_ITERS + 1 :]]
TRAIN += ["--micro-batch-size", "2", "--save-interval", "8", *ROPE]  # the later flag wins
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [90, 91, 92, 93]]
NEW_TOKENS = 8
TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [2, 7, 1, 8] * 3])
generate_tool = load_tool("tools/generate_text.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """16 iterations trained at 1 rank and at CP2, saved at iterations 8 and 16."""
    root = tmp_path_factory.mktemp("cp-generation")
    run(1, TRAIN + ["--save", str(root / "one-rank")])
    run(2, TRAIN + CP2 + ["--save", str(root / "cp2")])
    return {"one-rank": root / "one-rank", "cp2": root / "cp2"}


def _tokens_and_logits(load: str, tp: int, step: int | None = None):
    state = ParallelState.single() if tp == 1 else ParallelState.build(tp, 1)
    model = load_inference_model(load, state, ckpt_step=step)
    tokens = [r.tokens for r in generate(model, PROMPTS, NEW_TOKENS)]
    return tokens, full_logits(model, TOKENS)


def _on_ranks(rank: int, world: int, loads: list[str]) -> list:
    return [_tokens_and_logits(load, world) for load in loads]


def test_a_checkpoint_trained_at_cp2_generates_the_one_rank_tokens(checkpoints) -> None:
    one_rank, cp2 = str(checkpoints["one-rank"]), str(checkpoints["cp2"])
    tokens, logits = _tokens_and_logits(one_rank, 1)
    earlier_tokens, earlier_logits = _tokens_and_logits(one_rank, 1, step=8)
    # controls: iteration 8's model gives other logits, and greedy writes more than one token
    assert (earlier_logits - logits).abs().max() > 1e-3
    assert all(len(set(t)) > 1 for t in tokens)
    at_one_rank = _tokens_and_logits(cp2, 1)
    at_tp2 = run_distributed(_on_ranks, 2, [cp2, one_rank])
    for got_tokens, got_logits in [at_one_rank, *(r for rank in at_tp2 for r in rank)]:
        assert got_tokens == tokens
        torch.testing.assert_close(got_logits, logits, rtol=TOLERANCE, atol=TOLERANCE)
    assert _tokens_and_logits(cp2, 1, step=8)[0] == earlier_tokens


def test_the_generation_tool_refuses_context_parallelism_in_one_line(checkpoints, capsys) -> None:
    ckpt = str(checkpoints["cp2"])
    common = ["--load", ckpt, "--prompt", "5 6 7", "--max-new-tokens", "4", "--greedy"]
    status = generate_tool.main([*common, "--context-parallel-size", "2"])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "--context-parallel-size 2" in err and "without context parallelism" in err
    # 1 (a training command line's flag) changes nothing
    assert generate_tool.main(common) == 0
    plain = capsys.readouterr().out
    assert generate_tool.main([*common, "--context-parallel-size", "1"]) == 0
    assert capsys.readouterr().out == plain
    assert plain.startswith("5 6 7 ")
