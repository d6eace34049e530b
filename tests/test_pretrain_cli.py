"""End-to-end runs of pretrain_gpt.py, as users launch it: plain python and torchrun on CPU.

One module-scoped fixture starts the layouts concurrently (each run is a few tiny steps) and
every test reads their captured output. The log-line regex is written out here, independently
of megapipe.training.log_format, so a formatting slip cannot hide behind a shared constant.
"""

from __future__ import annotations

import glob
import math
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import pretrain_command, pretrain_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "pretrain_gpt.py")
TIMEOUT_S = 180

TRAIN_ITERS = 8
GLOBAL_BATCH = 4
LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 32, 256
TINY_GPT = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
    "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
    "--mock-data", "--eval-iters", "0", "--vocab-size", str(VOCAB),
    "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
    "--train-iters", str(TRAIN_ITERS), "--lr", "3e-3", "--log-interval", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
]  # fmt: skip

# Megatron's training_log line, field widths included.
LOG_LINE = re.compile(
    r"^ iteration (?P<it>[ \d]{8})/(?P<iters>[ \d]{8}) \|"
    r" consumed samples: (?P<consumed>[ \d]{12}) \|"
    r" elapsed time per iteration \(ms\): \d+\.\d \|"
    r" learning rate: (?P<lr>\d\.\d{6}E[+-]\d\d) \|"
    r" global batch size: (?P<gbs>[ \d]{5}) \|"
    r" lm loss: (?P<loss>\d\.\d{6}E[+-]\d\d) \|"
    r" loss scale: 1\.0 \|"
    r" grad norm: (?P<norm>\d+\.\d{3}) \|"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|$"
)
PARAM_LINE = re.compile(
    r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)$"
)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def log_lines(self) -> list[re.Match]:
        return [m for line in self.stdout.splitlines() if (m := LOG_LINE.match(line))]

    def losses(self) -> list[float]:
        return [float(m["loss"]) for m in self.log_lines()]

    def grad_norms(self) -> list[float]:
        return [float(m["norm"]) for m in self.log_lines()]

    def param_counts(self) -> dict[tuple[int, int], int]:
        found = [PARAM_LINE.match(line) for line in self.stdout.splitlines()]
        return {(int(m[1]), int(m[2])): int(m[3]) for m in found if m}


LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    # --sequence-parallel is dropped with TP=1 (same model as tp1), with one warning from rank 0
    "dp2": (2, ["--sequence-parallel"]),
}
SP_WARNING = "pretrain_gpt.py: warning: --sequence-parallel has no effect"


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    procs = {
        name: subprocess.Popen(
            pretrain_command(nproc, TINY_GPT + extra),
            cwd=ROOT,
            env=pretrain_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (nproc, extra) in LAYOUTS.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=TIMEOUT_S)
            done[name] = Run(proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def expected_parameters(tp: int) -> int:
    """Parameters one TP rank holds for TINY_GPT (bias, tied embeddings, learned positions)."""
    h, f = HIDDEN, 4 * HIDDEN
    padded_vocab = math.ceil(VOCAB / (128 * tp)) * 128 * tp
    layer = 2 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h  # norm, qkv, proj (+bias)
    layer += 2 * h + (h * f + f) // tp + f * h // tp + h  # norm, fc1, fc2 (+bias)
    return padded_vocab * h // tp + SEQ * h + LAYERS * layer + 2 * h


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_run_succeeds_and_logs_every_iteration_once(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.returncode == 0, f"{name} failed:\n{run.stderr[-3000:]}"
    lines = run.log_lines()
    assert len(lines) == TRAIN_ITERS, run.stdout
    starts = [line for line in run.stdout.splitlines() if line.startswith(" iteration")]
    assert len(starts) == TRAIN_ITERS  # no malformed or duplicated lines
    for i, m in enumerate(lines, start=1):
        assert int(m["it"]) == i and int(m["iters"]) == TRAIN_ITERS
        assert int(m["consumed"]) == i * GLOBAL_BATCH
        assert int(m["gbs"]) == GLOBAL_BATCH
        # Megatron's default schedule: linear decay to 0 over --train-iters, logged after step i
        assert float(m["lr"]) == pytest.approx(3e-3 * (1 - i / TRAIN_ITERS), abs=1e-9)
        assert int(m["skipped"]) == 0 and int(m["nan"]) == 0
    assert "Traceback" not in run.stderr
    warned = [line for line in run.stderr.splitlines() if line.startswith(SP_WARNING)]
    assert len(warned) == (1 if name == "dp2" else 0), run.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "world", "dp", "tp", "counts"),
    [
        ("tp1", 1, 1, 1, {(0, 0): expected_parameters(1)}),
        ("tp2", 2, 1, 2, {(0, 0): expected_parameters(2), (1, 0): expected_parameters(2)}),
        ("dp2", 2, 2, 1, {(0, 0): expected_parameters(1)}),  # data-parallel rank 0 only
    ],
)
def test_startup_lines(runs: dict[str, Run], name, world, dp, tp, counts) -> None:
    stdout = runs[name].stdout
    header = (
        f"using world size: {world}, data-parallel size: {dp}, "
        f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: 1"
    )
    assert stdout.splitlines().count(header) == 1, stdout
    assert runs[name].param_counts() == counts
    assert len([line for line in stdout.splitlines() if PARAM_LINE.match(line)]) == len(counts)


@pytest.mark.slow
def test_layouts_print_the_same_losses(runs: dict[str, Run]) -> None:
    reference = runs["tp1"].losses()
    assert len(reference) == TRAIN_ITERS
    for name in LAYOUTS:
        assert runs[name].losses() == pytest.approx(reference, rel=1e-5), name
        assert runs[name].grad_norms() == pytest.approx(runs["tp1"].grad_norms(), abs=2e-3), name


@pytest.mark.slow
def test_loss_decreases(runs: dict[str, Run]) -> None:
    losses = runs["tp1"].losses()
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)  # near-uniform at init
    assert losses[-1] < losses[0] - 0.3, losses
    half = TRAIN_ITERS // 2
    assert sum(losses[half:]) < sum(losses[:half]), losses


@pytest.mark.slow
def test_bad_flag_exits_on_every_rank_with_one_line(tmp_path: Path) -> None:
    bad = list(TINY_GPT)
    bad[bad.index("--hidden-size") + 1] = "100"
    bad[bad.index("--num-attention-heads") + 1] = "3"
    message = (
        "pretrain_gpt.py: error: --hidden-size (100) must be divisible by --num-attention-heads (3)"
    )
    # Per-rank stderr goes to files, so we see what each rank printed, apart from the launcher's
    # own report; a slow monitor interval lets the second rank finish before it is stopped.
    launcher = ["--log-dir", str(tmp_path), "--redirects", "2", "--monitor-interval", "2"]
    start = time.monotonic()
    proc = subprocess.run(
        pretrain_command(2, bad, *launcher),
        cwd=ROOT,
        env=pretrain_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f} s: validation must fail fast, not hang"
    rank_files = sorted(glob.glob(str(tmp_path / "**" / "stderr.log"), recursive=True))
    assert len(rank_files) == 2, rank_files
    for path in rank_files:
        assert Path(path).read_text().splitlines() == [message], path
    assert "exitcode  : 2" in proc.stderr  # the launcher's report of the first rank's status
    # The launcher prints its own ChildFailedError traceback; none may come from our code.
    assert f'{SCRIPT}", line' not in proc.stderr
    assert str(ROOT / "megapipe") not in proc.stderr


@pytest.mark.parametrize(
    ("world_size", "change", "message"),
    [
        (None, {"--mock-data": None}, "no dataset: pass --mock-data"),
        ("3", {"--tensor-model-parallel-size": "2"}, "world size (3) is not divisible"),
        ("two", {}, "environment variable WORLD_SIZE='two' is not an integer"),
        (None, {"--bogus": "1"}, "unrecognized arguments: --bogus 1"),
    ],
)
def test_main_reports_config_errors_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], world_size, change, message
) -> None:
    import pretrain_gpt

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    args = list(TINY_GPT)
    for flag, value in change.items():
        if flag in args:
            i = args.index(flag)
            del args[i : i + (1 if value is None or args[i + 1].startswith("--") else 2)]
        if value is not None:
            args += [flag, value]
    assert pretrain_gpt.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), captured.err
    assert message in lines[0]
