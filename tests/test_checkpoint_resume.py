"""Checkpoints through the training product: a run stopped at iteration k and resumed prints the
same losses and grad norms, to the last digit, as the run that never stopped (one rank; TP2 x
PP2 x DP2 with the distributed optimizer, the interleaved schedule and dropout; real data with
evaluation; fp16's loss scaler); a checkpoint saved at one layout continues at others; bad
--load input is one clear error."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megapipe.arguments import parse_args
from megapipe.errors import ConfigError
from megapipe.testing import DistributedTestError
from tests.helpers import (
    MOCK,
    MODEL,
    NO_DROPOUT,
    THREE_D,
    pretrain_command,
    pretrain_env,
    printed,
    run,
)


def stop_and_resume(world: int, flags: list[str], save: Path, k: int = 3):
    """The uninterrupted run, and the same run stopped after k iterations and resumed."""
    whole, whole_out = run(world, flags)
    first, _ = run(world, flags + ["--save", str(save), "--exit-interval", str(k)])
    assert len(first) == k and (
        save / "latest_checkpointed_iteration.txt"
    ).read_text().strip() == str(k)
    second, second_out = run(world, flags + ["--load", str(save), "--save", str(save)])
    return whole, whole_out, first + second, second_out


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (1, NO_DROPOUT),
        pytest.param(
            8,
            THREE_D + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["one-rank", "tp2-pp2-dp2-distopt-interleaved-dropout"],
)
def test_resume_is_exact(world: int, layout: list[str], tmp_path: Path) -> None:
    whole, whole_out, resumed, resumed_out = stop_and_resume(
        world, MODEL + MOCK + layout, tmp_path / "ckpt"
    )
    assert [(r.lm_loss, r.grad_norm) for r in resumed] == [(r.lm_loss, r.grad_norm) for r in whole]
    after = printed(resumed_out)
    assert sorted(after) == [4, 5, 6]
    assert after == {i: v for i, v in printed(whole_out).items() if i > 3}


def test_async_save_resumes_exactly_and_is_complete_before_exit(tmp_path: Path) -> None:
    flags = MODEL + MOCK + NO_DROPOUT + ["--pipeline-model-parallel-size", "2", "--async-save"]
    whole, _, resumed, _ = stop_and_resume(2, flags, tmp_path / "ckpt")
    assert [(r.lm_loss, r.grad_norm) for r in resumed] == [(r.lm_loss, r.grad_norm) for r in whole]
    # the last save (at the end) was finished and published before the run returned
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_resume_with_fp16_keeps_the_loss_scaler(tmp_path: Path) -> None:
    flags = MODEL + MOCK + NO_DROPOUT + ["--fp16", "--initial-loss-scale", "4096",
                                         "--num-layers", "2", "--hidden-size", "16"]  # fmt: skip
    whole, whole_out, resumed, resumed_out = stop_and_resume(1, flags, tmp_path / "ckpt")
    assert [(r.lm_loss, r.grad_norm) for r in resumed] == [(r.lm_loss, r.grad_norm) for r in whole]
    scale = re.compile(r"loss scale: (\S+) \|")
    assert scale.findall(resumed_out) == scale.findall(whole_out)[3:]


def test_resume_on_real_data_continues_the_sample_order_and_the_validations(
    tmp_path: Path, demo_prefix: str, sp_model: Path
) -> None:
    data = ["--data-path", demo_prefix, "--split", "90,8,2", "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", str(sp_model),
            "--eval-interval", "2", "--eval-iters", "1"]  # fmt: skip
    flags = MODEL + NO_DROPOUT + data
    whole, whole_out, resumed, resumed_out = stop_and_resume(2, flags, tmp_path / "ckpt", k=2)
    assert [(r.lm_loss, r.grad_norm) for r in resumed] == [(r.lm_loss, r.grad_norm) for r in whole]
    validation = re.compile(r"validation loss at (iteration \d+[^|]*)\| lm loss value: (\S+)")
    assert validation.findall(resumed_out) == [
        v for v in validation.findall(whole_out) if v[0] != "iteration 2 "
    ]


@pytest.fixture(scope="module")
def saved_at_3d(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    """A TP2 x PP2 x DP2 run (distributed optimizer, interleaved, tied embeddings across the
    stages), and its checkpoint at iteration 3."""
    save = tmp_path_factory.mktemp("ckpt3d")
    reference, _ = run(8, MODEL + MOCK + NO_DROPOUT + THREE_D)
    run(8, MODEL + MOCK + NO_DROPOUT + THREE_D + ["--save", str(save), "--exit-interval", "3"])
    return reference, save


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (8, ["--pipeline-model-parallel-size", "4", "--use-distributed-optimizer"]),
        (8, ["--tensor-model-parallel-size", "4", "--use-distributed-optimizer"]),
        (1, []),
    ],
    ids=["tp1-pp4-dp2", "tp4-pp1-dp2", "one-rank"],
)
def test_a_checkpoint_continues_at_another_layout(world, layout, saved_at_3d) -> None:
    reference, save = saved_at_3d
    continued, _ = run(world, MODEL + MOCK + NO_DROPOUT + layout + ["--load", str(save)])
    assert [r.lm_loss for r in continued] == pytest.approx(
        [r.lm_loss for r in reference[3:]], rel=1e-5
    )
    assert [r.grad_norm for r in continued] == pytest.approx(
        [r.grad_norm for r in reference[3:]], rel=1e-5
    )


def test_finetune_loads_the_weights_and_restarts_the_count(tmp_path: Path) -> None:
    flags = MODEL + MOCK + NO_DROPOUT
    save = tmp_path / "ckpt"
    scratch, _ = run(1, flags)
    run(1, flags + ["--save", str(save), "--exit-interval", "3"])
    tuned, out = run(1, flags + ["--load", str(save), "--finetune"])
    assert sorted(printed(out)) == [1, 2, 3, 4, 5, 6]  # the count restarts
    assert tuned[0].lm_loss < scratch[0].lm_loss  # from trained weights, on the same batch


@pytest.mark.slow
def test_a_load_at_or_past_train_iters_says_so_and_exits_0(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    flags = MODEL + MOCK + NO_DROPOUT + ["--num-layers", "2", "--train-iters", "3"]
    run(1, flags + ["--save", str(save)])
    again = subprocess.run(
        pretrain_command(1, flags + ["--load", str(save), "--train-iters", "2"]),
        capture_output=True,
        text=True,
        timeout=180,
        env=pretrain_env(),
    )
    assert again.returncode == 0, again.stderr
    lines = [line for line in again.stdout.splitlines() if "nothing to train" in line]
    assert lines == [
        f"nothing to train: the checkpoint loaded from {save} is at iteration 3, already at or "
        "past --train-iters 2"
    ]
    assert printed(again.stdout) == {}  # no iteration ran


def test_load_errors_are_one_line(tmp_path: Path) -> None:
    flags = MODEL + MOCK + NO_DROPOUT
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.warns(UserWarning):
        configs = parse_args(flags + ["--load", str(empty)], 1)
    assert any("no checkpoint found" in n and "starts from scratch" in n for n in configs.warnings)
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint"):
        parse_args(flags + ["--load", str(empty), "--exit-on-missing-checkpoint"], 1)
    save = tmp_path / "ckpt"
    run(1, flags + ["--save", str(save), "--exit-interval", "2"])
    with pytest.raises(ConfigError, match=r"--ckpt-step 7: .*iter_0000007 does not exist"):
        parse_args(flags + ["--load", str(save), "--ckpt-step", "7"], 1)
    wider = flags + ["--hidden-size", "64", "--load", str(save)]
    with pytest.raises(DistributedTestError) as error:
        run(2, wider + ["--tensor-model-parallel-size", "2"])
    assert (
        "tensor embedding.word_embeddings.weight has global shape (128, 32) in the checkpoint, "
        "(128, 64) in this model" in str(error.value)
    )


@pytest.mark.slow
def test_a_corrupt_checkpoint_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    flags = MODEL + MOCK + NO_DROPOUT + ["--pipeline-model-parallel-size", "2"]
    save = tmp_path / "ckpt"
    run(2, flags + ["--save", str(save), "--exit-interval", "2"])
    shard = next((save / "iter_0000002").glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit
    shard.write_bytes(bytes(data))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(root / "pretrain_gpt.py"), *flags, "--load", str(save)]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 2, done.stderr[-3000:]  # one line from each rank, nobody hangs
    assert all(shard.name in line and "(corrupted)" in line for line in errors), errors
