"""Checkpoints that Megatron-LM wrote load in megapipe: generation, training and conversion.

The checkpoints are written by Megatron-Core 0.16.1 itself, laid out as Megatron-LM's
`save_checkpoint` lays them out (tests/megatron_lm_checkpoints.py): a GPT-2-like model (learned
positions, LayerNorm, GeLU, tied embeddings) and a Llama-like one (rope, RMSNorm, SwiGLU, GQA,
untied, no biases), each in torch_dist at TP1 (iteration 5) and in the legacy torch format at
TP2 x PP2 (`release`). The vocabulary is NullTokenizer's 100 ids padded to 128 rows, and the
output layer's padding rows are made large enough to win every argmax (they do, for the Llama
one), so a generator that does not mask them is caught. The reference is Megatron-Core's own
model: its logits and its greedy continuation over the real vocabulary.
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's checkpoint writer needs it

from megapipe.checkpointing import megatron_lm  # noqa: E402
from megapipe.checkpointing.errors import CheckpointError  # noqa: E402
from megapipe.checkpointing.tracker import RELEASE, read_tracker  # noqa: E402
from megapipe.errors import ConfigError  # noqa: E402
from megapipe.inference.generation import generate  # noqa: E402
from megapipe.inference.loading import load_inference_model  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from tests import megatron_lm_checkpoints as mlm  # noqa: E402
from tests.helpers import LOSS_LINE, convert_gpt, run  # noqa: E402

KINDS = ("gpt", "llama")
FORMATS = ("torch_dist", "torch")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """kind -> {"torch_dist": load dir, "torch": load dir, "ref": Megatron-Core's outputs}."""
    root = tmp_path_factory.mktemp("megatron_lm")
    out = {}
    for kind in KINDS:
        dist, legacy = root / f"{kind}_dist", root / f"{kind}_legacy"
        dist.mkdir()
        legacy.mkdir()
        (ref,) = run_distributed(mlm.write_torch_dist, 1, kind, str(dist), timeout=240)
        run_distributed(mlm.write_legacy, 4, kind, str(dist), str(legacy), 2, timeout=240)
        out[kind] = {"torch_dist": str(dist), "torch": str(legacy), "ref": ref}
    return out


def _greedy(rank: int, world: int, load: str, tp: int, pp: int) -> list[int]:
    state = ParallelState.build(tp, pp) if world > 1 else ParallelState.single()
    model = load_inference_model(load, state)
    (result,) = generate(model, [mlm.PROMPT], mlm.NEW_TOKENS)
    return result.tokens


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_generation_gives_megatron_cores_greedy_tokens(written, kind, fmt, layout) -> None:
    ref = written[kind]["ref"]
    tp, pp = layout
    if tp * pp == 1:
        tokens = _greedy(0, 1, written[kind][fmt], 1, 1)
    else:
        tokens = run_distributed(_greedy, tp * pp, written[kind][fmt], tp, pp, timeout=120)[-1]
    assert tokens == ref["tokens"], (tokens, ref["tokens"])
    assert all(t < mlm.REAL_VOCAB for t in tokens)


def test_the_padding_rows_would_win_unmasked(written) -> None:
    """The check above can fail: Megatron-Core's unmasked argmax is a padding id."""
    assert written["llama"]["ref"]["padding_wins"]


def test_a_release_tracker_and_the_run_the_args_describe(written) -> None:
    legacy, dist = written["llama"]["torch"], written["gpt"]["torch_dist"]
    assert read_tracker(legacy) == RELEASE
    run_ = megatron_lm.read_run(os.path.join(legacy, "release"), release=True)
    assert (run_.format, run_.tp, run_.pp, run_.vocab_size, run_.padded_vocab_size) == (
        "torch", 2, 2, mlm.REAL_VOCAB, mlm.PADDED_VOCAB,
    )  # fmt: skip
    assert run_.progress.iteration == 0 and run_.scheduler is None  # release: weights only
    run_ = megatron_lm.read_run(os.path.join(dist, f"iter_{mlm.ITERATION:07d}"))
    assert run_.progress.iteration == mlm.ITERATION
    assert run_.progress.consumed_samples == mlm.ITERATION * mlm.GLOBAL_BATCH
    assert run_.args["layernorm_epsilon"] == "1e-05"  # Megatron's norm_epsilon, our name
    assert "AttnBackend" in run_.args["attention_backend"]  # an enum, read as data


COMMON = [
    "--mock-data", "--micro-batch-size", "1", "--global-batch-size", str(mlm.GLOBAL_BATCH),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _megatron_lr(step_samples: int) -> float:
    """Megatron's cosine schedule (warmup 2 x 4 samples, decay over 20 x 4) at num_steps."""
    import math

    warmup, decay, lr, min_lr = 8, 80, 1e-3, 1e-4
    if step_samples <= warmup:
        return lr * step_samples / warmup
    ratio = (step_samples - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_training_continues_from_a_megatron_lm_checkpoint(written) -> None:
    """--use-checkpoint-args builds the model from the checkpoint's args; training continues at
    iteration 6 on Megatron's LR schedule (the saved clock of 20 samples), and its first loss
    is that of Megatron-Core's weights (far below a fresh model's)."""
    load = written["gpt"]["torch_dist"]
    flags = [*COMMON, "--load", load, "--use-checkpoint-args", "--train-iters", "20",
             "--exit-interval", "7"]  # fmt: skip
    _, stdout = run(1, flags)
    lines = {int(m[1]): m for m in map(LOSS_LINE.match, stdout.splitlines()) if m}
    assert sorted(lines) == [6, 7], stdout[-2000:]
    lrs = [float(line.split("learning rate: ")[1].split(" ")[0]) for line in stdout.splitlines()
           if line.startswith(" iteration")]  # fmt: skip
    assert lrs == pytest.approx([_megatron_lr(24), _megatron_lr(28)], rel=1e-6)
    assert "consumed samples:           24" in stdout
    assert "was written by Megatron-LM (torch_dist, TP 1 x PP 1)" in stdout


def test_without_model_flags_the_checkpoint_gives_them(written) -> None:
    """No --num-layers etc. on the command line (they are required otherwise): the missing
    ones come from the checkpoint --load names; the Llama model (rope, RMSNorm, SwiGLU, GQA,
    untied) continues as saved."""
    load = written["llama"]["torch_dist"]
    _, stdout = run(1, [*COMMON, "--load", load, "--train-iters", "20", "--exit-interval", "6"])
    assert [int(m[1]) for m in map(LOSS_LINE.match, stdout.splitlines()) if m] == [6], stdout


def test_the_schedule_rule_and_finetune_apply_to_megatron_lm_checkpoints(written) -> None:
    load = written["gpt"]["torch_dist"]
    flags = [*COMMON, "--load", load, "--use-checkpoint-args", "--train-iters", "8"]
    with pytest.raises(
        Exception, match="--train-iters: lr_decay_steps 32 here, 80 in the checkpoint"
    ):
        run(1, flags)
    _, stdout = run(1, [*flags, "--finetune"])
    assert sorted(int(m[1]) for m in map(LOSS_LINE.match, stdout.splitlines()) if m) == list(
        range(1, 9)
    )


def test_a_model_that_differs_from_the_checkpoint_is_refused_in_one_line(written) -> None:
    load = written["gpt"]["torch_dist"]
    flags = [*COMMON, "--load", load, "--train-iters", "20", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "99", "--swiglu"]  # fmt: skip
    with pytest.raises(Exception, match="the model differs from the one Megatron-LM saved"):
        run(1, flags)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_convert_to_hugging_face_in_one_command(written, kind, fmt, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    argv = ["--saver", "hf", "--load-dir", written[kind][fmt], "--save-dir", str(out)]
    assert convert_gpt(*argv) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == ("GPT2LMHeadModel" if kind == "gpt" else "LlamaForCausalLM")
    with torch.no_grad():
        logits = model(torch.tensor([mlm.PROMPT])).logits[0]
    assert logits.shape[-1] == mlm.REAL_VOCAB
    assert (logits - written[kind]["ref"]["logits"]).abs().max() < 1e-5


def test_convert_to_a_megapipe_layout_and_back_to_the_same_tokens(written, tmp_path) -> None:
    out = tmp_path / "tp2"
    argv = ["--load-dir", written["llama"]["torch"], "--save-dir", str(out),
            "--target-tensor-parallel-size", "2"]  # fmt: skip
    assert convert_gpt(*argv) == 0
    assert read_tracker(str(out)) == 0  # a release checkpoint becomes iteration 0
    tokens = run_distributed(_greedy, 2, str(out), 2, 1, timeout=120)[-1]
    assert tokens == written["llama"]["ref"]["tokens"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_pickles_that_carry_code_are_refused_in_one_line(written, tmp_path: Path) -> None:
    """A Megatron-LM common.pt whose args hold an object that would run code when unpickled,
    or a Megatron-Core type outside the allow-list, is refused naming what it needs."""
    for payload, needs in (
        (argparse.Namespace(num_layers=2, hook=_Evil()), "posix.system"),
        (argparse.Namespace(num_layers=2, x=pickle.PickleError()), "PickleError"),
    ):
        directory = tmp_path / f"case{len(needs)}"
        directory.mkdir()
        torch.save({"args": payload, "iteration": 1}, directory / "common.pt")
        assert not megatron_lm.is_megatron_lm(str(directory))
        with pytest.raises(
            CheckpointError, match=f"refused by weights_only loading: it needs .*{needs}"
        ):
            megatron_lm.read_run(str(directory))


def test_a_missing_mp_rank_file_is_named(written, tmp_path: Path) -> None:
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(written["gpt"]["torch"], legacy)
    os.remove(legacy / "release" / "mp_rank_01_001" / "model_optim_rng.pt")
    with pytest.raises(
        (CheckpointError, ConfigError), match="mp_rank_01_001/model_optim_rng.pt is missing"
    ):
        load_inference_model(str(legacy), ParallelState.single())
