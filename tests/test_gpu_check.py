"""The GPU check's harness on CPU: tools/gpu_check.sh parses and refuses a machine without CUDA
in one line; its GPU count (torch's, no nvidia-smi) and its multi-gpu decision (skipped, with
the reason, below two GPUs); its multi-gpu command (torchrun pretrain_gpt.py, 2 ranks, PP=2)
run on gloo ranks; benchmarks/gpu_training_check.py and benchmarks/bench_gpu_mfu.py run end to
end at their --tiny sizes (real pretrain_gpt.py runs) and their verdicts and numbers are
checked against the values they report, recomputed here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_training_check as gtc  # noqa: E402

from megapipe.config import ModelConfig  # noqa: E402
from megapipe.training.flops import flops_per_iteration  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")], check=True, timeout=30)


@pytest.mark.slow
def test_gpu_check_without_cuda_is_one_line_and_status_2(tmp_path) -> None:
    env = _env(CUDA_VISIBLE_DEVICES="", GPU_CHECK_OUT=str(tmp_path / "o"))
    script = str(ROOT / "tools" / "gpu_check.sh")
    done = subprocess.run(
        ["bash", script], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode == 2
    assert done.stderr.startswith("gpu_check: no CUDA device here")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def _sourced(command: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`command` in a bash that sourced tools/gpu_check.sh (which then only defines things),
    with a PATH of bash, dirname and python only: no nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, target in (("bash", "/bin/bash"), ("dirname", "/usr/bin/dirname"),
                         ("python", sys.executable)):  # fmt: skip
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(target)
    script = ROOT / "tools" / "gpu_check.sh"
    return subprocess.run(
        ["/bin/bash", "-c", f"source {script} && {command}"], capture_output=True, text=True,
        timeout=120, cwd=tmp_path, env=_env(PATH=str(bin_dir), **env),
    )  # fmt: skip


@pytest.mark.slow
def test_gpu_count_is_torchs_without_nvidia_smi(tmp_path) -> None:
    done = _sourced("command -v nvidia-smi; gpu_count", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(torch.cuda.device_count())  # 0 here; no nvidia-smi line
    hidden = _sourced("gpu_count", tmp_path, CUDA_VISIBLE_DEVICES="")
    assert hidden.stdout.strip() == "0"
    broken = _sourced("gpu_count", tmp_path, PYTHON="/bin/false")  # no torch: 0, no error
    assert broken.stdout.strip() == "0" and broken.returncode == 0


def test_the_cuda_part_selects_every_test_that_needs_cuda() -> None:
    # every file with a test skipped for want of CUDA contributes to `pytest -m cuda`
    needing = sorted(
        path.name
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != "test_gpu_check.py"
        and any(
            pattern in path.read_text()
            for pattern in ("skipif(not torch.cuda.is_available()", "and torch.cuda.is_available()")
        )
    )
    # those files (and test_arguments.py, whose CUDA skip is the other way round) collected
    # as the part collects the whole suite, through the same conftest
    files = [f"tests/{name}" for name in [*needing, "test_arguments.py"]]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", *files],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(),
    )  # fmt: skip
    selected = {  # `-q --collect-only` prints "tests/test_x.py: COUNT" per file
        line.split(":")[0].removeprefix("tests/")
        for line in done.stdout.splitlines()
        if line.startswith("tests/test_")
    }
    assert len(needing) >= 5 and set(needing) <= selected, (needing, selected)
    assert "test_arguments.py" not in selected  # its CUDA skip is the CPU-only refusal's


def test_each_part_can_run_alone_and_an_unknown_one_is_named(tmp_path) -> None:
    assert _sourced("selected_parts", tmp_path).stdout.split() == [
        "cuda-tests", "training", "mfu", "bench", "multi-gpu"
    ]  # fmt: skip
    picked = _sourced("selected_parts --parts multi-gpu,cuda-tests", tmp_path)
    assert picked.stdout.split() == ["multi-gpu", "cuda-tests"]
    wrong = _sourced("selected_parts --parts kernels", tmp_path)
    assert wrong.returncode == 2 and "unknown part 'kernels'" in wrong.stderr
    # every cap under 9 minutes: a 10-minute device command holds any one part
    caps = [
        int(c)
        for c in re.findall(r"part [a-z-]+ (\d+) ", (ROOT / "tools" / "gpu_check.sh").read_text())
    ]
    assert len(caps) == 5 and max(caps) < 9 * 60


@pytest.mark.slow
def test_a_run_not_finished_in_time_prints_every_ranks_stacks_and_goes_on(tmp_path) -> None:
    # two stand-in ranks (named pretrain_gpt.py, as the part's ranks are) that install the
    # stack dump pretrain_gpt.py installs and then wait, under one parent, as torchrun's are
    assert "install_stack_dump()" in (ROOT / "pretrain_gpt.py").read_text()
    rank = tmp_path / "pretrain_gpt.py"
    rank.write_text(
        f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from megapipe.stack_dump import install_stack_dump\n"
        "install_stack_dump()\nprint('ready', flush=True)\ntime.sleep(5)\n"
    )
    script = ROOT / "tools" / "gpu_check.sh"
    command = f"with_stack_dumps 3 bash -c 'python {rank} & python {rank} & wait'; echo status $?"
    done = subprocess.run(
        ["/bin/bash", "-c", f"source {script} && {command}"], capture_output=True, text=True,
        timeout=120, cwd=tmp_path, env=_env(),
    )  # fmt: skip
    assert "gpu_check: not finished after 3 s" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("ready") == 2 and "status 0" in done.stdout  # both went on
    assert done.stderr.count("most recent call first") >= 2, done.stderr  # each rank's stack
    assert done.stderr.count(str(rank)) >= 2  # each stack names the stand-in rank's file


def test_multi_gpu_part_runs_with_two_gpus_and_says_why_it_skips_with_one(tmp_path) -> None:
    for gpus in (2, 8):
        assert _sourced(f"multi_gpu_plan {gpus}", tmp_path).stdout.strip() == "run"
    for gpus in (0, 1):
        line = _sourced(f"multi_gpu_plan {gpus}", tmp_path).stdout.strip()
        assert line.startswith(f"multi-gpu: skipped: {gpus} GPU(s) here")
        assert "NCCL refuses two ranks on one GPU" in line and "\n" not in line


@pytest.mark.slow
def test_multi_gpu_command_trains_two_pipeline_ranks_on_gloo(tmp_path) -> None:
    """The part's own command (torchrun pretrain_gpt.py, 2 ranks, PP=2) with gloo for NCCL."""
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--multi-gpu-run", "gloo"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(" iteration ")]
    assert [line.split()[1] for line in lines] == [f"{i}/" for i in range(1, 6)]
    assert "model parallel rank (0, 1)" in done.stdout  # the second pipeline stage ran
    assert "--attention-dropout" not in (ROOT / "tools" / "gpu_check.sh").read_text()
    losses = [float(line.split("lm loss:")[1].split()[0]) for line in lines]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Both harnesses at their --tiny sizes, run side by side (the slow part of this file)."""
    out = tmp_path_factory.mktemp("gpu_check")
    commands = {
        "training": [sys.executable, "benchmarks/gpu_training_check.py", "--tiny",
                     "--json", str(out / "training.json")],
        "mfu": [sys.executable, "benchmarks/bench_gpu_mfu.py", "--tiny", "--peak-tflops", "2",
                "--json", str(out / "mfu.json")],
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            command, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )  # fmt: skip
        for name, command in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        report = out / f"{name}.json"
        assert report.exists(), f"{name} wrote no report (status {proc.returncode}):\n{stderr}"
        results[name] = (proc.returncode, stdout, stderr, json.loads(report.read_text()))
    return results


@pytest.mark.slow
def test_training_check_tiny_runs_fp32_twice_and_passes(tiny_runs) -> None:
    status, stdout, stderr, report = tiny_runs["training"]
    assert status == 0, stderr
    lines = stdout.strip().splitlines()
    assert lines[-3].split()[:2] == ["run", "first"]  # the table is the last thing printed
    assert lines[-2].startswith("fp32 ") and lines[-1].startswith("fp32-repeat ")
    first, repeat = report["runs"]
    assert len(first["losses"]) == gtc.TINY_SIZE.iters == len(repeat["losses"])
    assert first["losses"] == repeat["losses"]  # the same run twice on CPU: bit-identical
    assert first["losses"][-1] < first["losses"][0] - report["min_drop"]
    assert repeat["max_relative_difference"] == 0.0 and not first["failures"]


def test_training_check_verdicts_can_fail() -> None:
    size = gtc.Size(**dict(gtc.asdict(gtc.TINY_SIZE), iters=3))
    baseline = gtc.Run("fp32", "fp32", losses=[5.0, 4.5, 4.0])
    gtc.judge(baseline, None, size, 0.5)
    assert baseline.failures == []
    cases = {
        "nan": ([5.0, float("nan"), 4.0], 0, "not finite"),
        "flat": ([5.0, 5.0, 4.9], 0, "loss fell"),
        "far": ([5.0, 4.5, 4.6], 0, "iteration 3: 1.50e-01 from fp32 > 0.05"),
        "short": ([5.0, 4.5], 0, "2 of 3 iterations"),
        "skipped": ([5.0, 4.5, 4.0], 2, "2 iterations skipped"),
    }
    for name, (losses, skipped, expected) in cases.items():
        run = gtc.Run(name, "bf16", losses=losses, skipped=skipped)
        gtc.judge(run, baseline, size, 0.5)
        assert any(expected in failure for failure in run.failures), (name, run.failures)
    ok = gtc.Run("bf16", "bf16", losses=[5.01, 4.52, 4.03])
    gtc.judge(ok, baseline, size, 0.5)
    assert ok.failures == [] and math.isclose(ok.max_relative_difference, 0.0075)


def test_parse_losses_reads_megatrons_log_line() -> None:
    line = (" iteration        2/      10 | consumed samples:           8 | elapsed time per "
            "iteration (ms): 12.5 | learning rate: 1.000000E-03 | global batch size:     4 | "
            "lm loss: 4.812345E+00 | loss scale: 4096.0 | grad norm: 1.234 | number of skipped "
            "iterations:   1 | number of nan iterations:   0 |")  # fmt: skip
    assert gtc.parse_losses(
        f"noise\n{line}\nvalidation loss at iteration 2 | lm loss value: 9\n"
    ) == ([4.812345], 1)


@pytest.mark.slow
def test_mfu_bench_tiny_reports_consistent_numbers(tiny_runs) -> None:
    status, stdout, stderr, report = tiny_runs["mfu"]
    assert status == 0, stderr
    lines = stdout.strip().splitlines()
    assert lines[-3].startswith("model ") and lines[-2].startswith("megapipe (fp32)")
    assert lines[-1].startswith("plain PyTorch (fp32)")
    size = report["size"]
    config = ModelConfig(num_layers=size["layers"], hidden_size=size["hidden"],
                         num_attention_heads=size["heads"], vocab_size=size["vocab"],
                         seq_length=size["seq"])  # fmt: skip
    assert report["flops_per_iteration"] == flops_per_iteration(
        config, size["global_batch"], padded_vocab_size=size["vocab"]
    )
    assert report["kernels"].startswith("kernels: ") and "=triton" not in report["kernels"]
    for row in report["rows"]:
        assert len(row["iteration_seconds"]) == 3 and all(t > 0 for t in row["iteration_seconds"])
        median = (
            sorted(row["iteration_seconds"][1:])[0] / 2
            + sorted(row["iteration_seconds"][1:])[1] / 2
        )
        assert math.isclose(row["seconds_per_iteration"], median)
        tflops = report["flops_per_iteration"] / median / 1e12
        assert math.isclose(row["tflops"], tflops) and math.isclose(row["mfu"], tflops / 2)
        assert math.isclose(row["tokens_per_second"], size["global_batch"] * size["seq"] / median)
