"""The training product's controls: Megatron's compatibility notes and refusals, batch-size
ramp-up, --train-samples, early exits (interval, duration, SIGTERM), throughput fields, the
memory line and TensorBoard, each through the same path as `pretrain_gpt.py`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megapipe.arguments import parse_args
from megapipe.errors import ConfigError
from megapipe.testing import run_distributed, train_with_flags

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
    "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip
LOG = re.compile(
    r"^ iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \| elapsed time per iteration "
    r"\(ms\): (\S+) \|(.*)\| global batch size: +(\d+) \|"
)


def logged(stdout: str) -> list[re.Match]:
    return [m for m in map(LOG.match, stdout.splitlines()) if m]


# --- Megatron-LM flags megapipe does not implement -------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--multi-latent-attention"], "--multi-latent-attention is a Megatron-LM flag that "
         "megapipe does not support yet"),
        (["--fp8", "e4m3"], "--fp8 is a Megatron-LM flag that megapipe does not support yet"),
        (["--spec=x"], "--spec is a Megatron-LM flag"),
        (["--hiden-size", "32"], "unrecognized arguments: --hiden-size 32 (--hiden-size: did "
         "you mean --hidden-size?)"),
    ],
)  # fmt: skip
def test_unsupported_flags_are_refused_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_args(BASE + ["--train-iters", "2"] + flags, 1)
    assert str(error.value).startswith(message)


def test_tp_comm_overlap_is_on_by_default_and_megatrons_switch_turns_it_off() -> None:
    base = BASE + ["--train-iters", "2"]
    assert parse_args(base, 1).parallel.tp_comm_overlap
    assert parse_args(base + ["--tp-comm-overlap"], 1).parallel.tp_comm_overlap
    off = base + ["--no-async-tensor-model-parallel-allreduce"]
    assert not parse_args(off, 1).parallel.tp_comm_overlap


def test_gpu_only_flags_are_accepted_and_noted_once() -> None:
    flags = ["--train-iters", "2", "--use-cpu-initialization", "--tp-comm-overlap",
             "--no-gradient-accumulation-fusion", "--context-parallel-size", "1",
             "--transformer-impl", "local", "--num-workers", "2"]  # fmt: skip
    with pytest.warns(UserWarning):
        configs = parse_args(BASE + flags, 1)
    notes = [n for n in configs.warnings if "has no effect here" in n]
    assert [n.split(" has no effect")[0] for n in notes] == [
        "--no-gradient-accumulation-fusion",
        "--use-cpu-initialization",
        "--num-workers 2",
    ]


# --- batch-size ramp-up and --train-samples --------------------------------------------------


RAMP = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-iters", "7"]


def test_ramp_up_follows_megatrons_rule_and_keeps_layout_parity() -> None:
    (single,) = run_distributed(train_with_flags, 1, BASE + RAMP)
    # +4 every 16/2 = 8 consumed samples, full once past 16: batches 4, 4, 8, 12, 12, 12, 12
    sizes = [int(m.group(5)) for m in logged(single[1])]
    consumed = [int(m.group(2)) for m in logged(single[1])]
    assert sizes == [4, 4, 8, 12, 12, 12, 12]
    assert consumed == [4, 8, 16, 28, 40, 52, 64]
    for world, layout in ((2, []), (4, ["--pipeline-model-parallel-size", "2"])):
        outputs = run_distributed(train_with_flags, world, BASE + RAMP + layout)
        results = outputs[0][0]
        assert [r.lm_loss for r in results] == pytest.approx(
            [r.lm_loss for r in single[0]], rel=1e-5
        )
        assert [r.grad_norm for r in results] == pytest.approx(
            [r.grad_norm for r in single[0]], rel=1e-5
        )


def test_ramp_up_steps_must_be_whole_micro_batches_per_rank() -> None:
    with pytest.raises(ConfigError, match=r"--rampup-batch-size start \(2\) must be a multiple"):
        parse_args(BASE + ["--global-batch-size", "12", "--rampup-batch-size", "2", "2", "8",
                           "--train-iters", "3"], 2)  # fmt: skip


def test_every_ramped_batch_must_suit_the_pipeline_schedule() -> None:
    interleaved = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
                   "--global-batch-size", "8", "--train-iters", "3"]  # fmt: skip
    parse_args(BASE + interleaved + ["--rampup-batch-size", "2", "2", "8"], 2)  # 2, 4, 6, 8
    with pytest.raises(ConfigError, match=r"micro-batches \(3\).*ramped global batch size 3 "):
        parse_args(BASE + interleaved + ["--rampup-batch-size", "2", "1", "8"], 2)


def test_train_samples_sets_the_number_of_iterations() -> None:
    configs = parse_args(BASE + ["--global-batch-size", "8", "--train-samples", "44"], 1)
    assert configs.training.train_iters == 5  # floor(44 / 8), as Megatron
    ramped = parse_args(
        BASE + ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16",
                "--train-samples", "64"], 1
    )  # fmt: skip
    assert ramped.training.train_iters == 7  # 4 + 4 + 8 + 12 x 4 = 64, as the ramp above
    with pytest.raises(ConfigError, match="exactly one of --train-iters and --train-samples"):
        parse_args(BASE + ["--train-iters", "3", "--train-samples", "8"], 1)
    with pytest.raises(ConfigError, match="--lr-decay-samples needs --train-samples"):
        parse_args(BASE + ["--train-iters", "3", "--lr-decay-samples", "8"], 1)


# --- early exits -----------------------------------------------------------------------------


def test_exit_interval_stops_every_rank_after_that_iteration() -> None:
    outputs = run_distributed(
        train_with_flags, 2, BASE + ["--train-iters", "10", "--exit-interval", "3"]
    )
    assert [len(results) for results, _ in outputs] == [3, 3]
    assert "exiting program at iteration 3 (--exit-interval)" in outputs[0][1]


def test_exit_duration_stops_all_ranks_together() -> None:
    outputs = run_distributed(
        train_with_flags,
        2,
        BASE + ["--train-iters", "50", "--exit-duration-in-mins", "1e-9",
                "--pipeline-model-parallel-size", "2"],
    )  # fmt: skip
    assert [len(results) for results, _ in outputs] == [1, 1]
    assert "exiting program after 1e-09 minutes" in outputs[0][1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        return [int(p) for p in file.read().split()]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_iteration_with_status_0(
    tmp_path: Path,
) -> None:
    save = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(ROOT / "pretrain_gpt.py"), *BASE, "--train-iters", "100000",
        "--pipeline-model-parallel-size", "2", "--exit-signal-handler", "--save", str(save),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        lines = []
        for line in agent.stdout:  # wait until training runs
            lines.append(line)
            if line.startswith(" iteration        3/"):
                break
        workers = _children(agent.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGTERM)  # one rank only: the all-reduce tells the other
        out, err = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, err[-3000:]
    stdout = "".join(lines) + out
    stopped = re.search(r"exiting program after receiving SIGTERM, at iteration (\d+)", stdout)
    assert stopped is not None, stdout[-2000:]
    last_logged = int(logged(stdout)[-1].group(1))
    assert last_logged == int(stopped.group(1))  # the last rank finished that iteration too
    # and the run was saved there before exiting, as Megatron does
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == stopped.group(1)


# --- throughput, memory, TensorBoard ---------------------------------------------------------


def test_throughput_fields_are_consistent_and_mfu_needs_a_peak() -> None:
    from megapipe.training.flops import flops_per_iteration

    flags = BASE + ["--global-batch-size", "8", "--train-iters", "3", "--log-throughput"]
    (plain,) = run_distributed(train_with_flags, 1, flags)
    assert "throughput per GPU (TFLOP/s/GPU): " in plain[1] and "MFU" not in plain[1]
    (peaked,) = run_distributed(train_with_flags, 1, flags + ["--device-peak-tflops", "0.001"])
    configs = parse_args(flags, 1)
    flops = flops_per_iteration(configs.model, 8, padded_vocab_size=128)
    for match in logged(peaked[1]):
        seconds = float(match.group(3)) / 1000.0
        fields = dict(re.findall(r" ([a-zA-Z /()]+?): ([0-9.e+-]+)%? ", match.group(4) + " "))
        tflops = float(fields["throughput per GPU (TFLOP/s/GPU)"])
        assert tflops == pytest.approx(flops / seconds / 1e12, rel=0.02)
        assert float(fields["tokens per second per GPU"]) == pytest.approx(
            8 * 16 / seconds, rel=0.02
        )
        assert float(fields["MFU"]) == pytest.approx(100 * tflops / 0.001, rel=0.02)


def test_each_rank_reports_its_memory_once() -> None:
    outputs = run_distributed(
        train_with_flags, 2, BASE + ["--train-iters", "3", "--tensor-model-parallel-size", "2"]
    )
    for rank, (_, stdout) in enumerate(outputs):
        lines = [line for line in stdout.splitlines() if "memory (MB)" in line]
        assert len(lines) == 1
        assert lines[0].startswith(f"[Rank {rank}] (after 1 iterations) memory (MB) | RSS: ")


def test_tensorboard_scalars_match_the_run(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    flags = BASE + [
        "--global-batch-size", "8", "--train-iters", "4", "--eval-interval", "2",
        "--eval-iters", "1", "--tensorboard-dir", str(tb), "--log-validation-ppl-to-tensorboard",
        "--pipeline-model-parallel-size", "2", "--log-timers-to-tensorboard", "--log-interval", "2",
    ]  # fmt: skip
    outputs = run_distributed(train_with_flags, 4, flags)
    results, stdout = outputs[0][0], outputs[-1][1]
    (events,) = tb.glob("events.out.tfevents.*")  # one writer for the whole job
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "loss-scale",
            "iteration-time", "lm loss validation", "lm loss validation ppl",
            "forward-backward-time"} <= tags  # fmt: skip
    assert "batch-size" not in tags  # Megatron writes it only with --log-batch-size-to-tensorboard
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r.lm_loss for r in results], rel=1e-6)
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [8, 16, 24, 32]
    grad = [e.value for e in acc.Scalars("grad-norm")]
    assert grad == pytest.approx([r.grad_norm for r in results], rel=1e-6)
    printed = re.findall(r"at iteration \d+(?: on validation set)? \| lm loss value: (\S+)", stdout)
    printed = [float(v) for v in printed]
    valid = acc.Scalars("lm loss validation")
    assert [e.step for e in valid] == [2, 4, 4]
    assert [e.value for e in valid] == pytest.approx(printed, rel=1e-6)
    assert "hidden_size" in acc.Tags()["tensors"] or any(
        "hidden_size" in t for t in acc.Tags().get("tensors", [])
    )


def test_tensorboard_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("")
    with pytest.raises(ConfigError, match=rf"--tensorboard-dir {path}: exists and is not a dir"):
        parse_args(BASE + ["--train-iters", "2", "--tensorboard-dir", str(path)], 1)
