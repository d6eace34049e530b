"""Megatron-LM's logging and profiling flags: --log-params-norm, --log-num-zeros-in-grad,
--log-memory-to-tensorboard, --log-world-size-to-tensorboard, --profile (torch.profiler and the
CPU note) and --wandb-project (read back from the offline run's transaction log)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megapipe.arguments import parse_args
from megapipe.data.mock import MockGPTDataset
from megapipe.errors import ConfigError
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags
from megapipe.training.build import build_run
from megapipe.training.log_format import iteration_line
from megapipe.training.profiling import profiler_for
from megapipe.training.train import TrainingLoop

HIDDEN, VOCAB, PADDED, SEQ, BATCH = 32, 100, 128, 16, 4
# Padded vocabulary 128 at TP1 and TP2 alike (64 x TP divides 128): the same model everywhere.
# No linear biases: the attention's key bias has a gradient of exactly zero in exact arithmetic
# (softmax ignores a shift shared by all keys), so its computed entries are rounding noise,
# now and then an exact 0.0 in one layout and not in another.
BASE = [
    "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(BATCH),
    "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "2",
    "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "64",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
]  # fmt: skip
MEASURES = ["--log-params-norm", "--log-num-zeros-in-grad"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],  # tied embeddings: a mirrored copy
    "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
    "dp2-fsdp2": ["--use-torch-fsdp2"],
}
FIELDS = re.compile(
    r"\| lm loss: (\S+) \| loss scale: \S+ \| grad norm: \S+ \| num zeros: (\S+) \| "
    r"params norm: (\S+) \| number of skipped iterations:"
)


def _train_and_norm(rank: int, world_size: int, argv: list[str]) -> tuple[list, str, float]:
    """A one-rank run's results and stdout, and the norm of its model's parameters after
    training, computed here from the modules themselves (not the optimizer's masters)."""
    configs = parse_args(argv, world_size)
    run = build_run(configs, ParallelState.build(1, 1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = TrainingLoop(run).run()
    params = [p.detach().double().reshape(-1) for c in run.chunks for p in c.parameters()]
    return results, out.getvalue(), float(torch.linalg.vector_norm(torch.cat(params)))


@pytest.fixture(scope="module")
def one_rank() -> tuple[list, str, float]:
    return run_distributed(_train_and_norm, 1, BASE + MEASURES)[0]


def test_params_norm_is_the_models_norm_and_printed_in_megatrons_order(one_rank) -> None:
    results, stdout, norm = one_rank
    assert results[-1].params_norm == pytest.approx(norm, rel=1e-6)
    printed = [m.groups() for m in map(FIELDS.search, stdout.splitlines()) if m]
    assert len(printed) == 2
    for (loss, zeros, params), result in zip(printed, results):
        assert float(loss) == pytest.approx(result.lm_loss, rel=1e-6)
        assert zeros == f"{result.num_zeros:.1f}" and params == f"{result.params_norm:.3f}"


def test_log_line_fields_follow_megatrons_order() -> None:
    common = dict(iteration=1, train_iters=2, consumed_samples=4, elapsed_ms_per_iteration=1.0,
                  learning_rate=1e-3, global_batch_size=4, losses={"lm loss": 2.0},
                  loss_scale=1.0, skipped_iterations=0, nan_iterations=0)  # fmt: skip
    line = iteration_line(grad_norm=1.5, num_zeros=7.0, params_norm=12.25, **common)
    assert (" loss scale: 1.0 | grad norm: 1.500 | num zeros: 7.0 | params norm: 12.250 |"
            " number of skipped iterations:   0 |") in line  # fmt: skip
    assert iteration_line(grad_norm=1.5, **common) == line.replace(
        " num zeros: 7.0 | params norm: 12.250 |", ""
    )  # without the flags, the line is unchanged


def test_num_zeros_counts_the_embedding_rows_no_token_used() -> None:
    """Untied embeddings: an input-embedding row gets a gradient only from the tokens of the
    batch; output-layer rows of the vocabulary's padding never do (their logits are left out
    of the loss). So each iteration's zeros are hidden x (unused padded rows + padding)."""
    results, _, _ = run_distributed(
        _train_and_norm, 1, BASE + MEASURES + ["--untie-embeddings-and-output-weights"]
    )[0]
    seed = parse_args(BASE, 1).training.seed
    data = MockGPTDataset(VOCAB, SEQ, seed)
    for iteration, result in enumerate(results):
        first = iteration * BATCH
        tokens = data.batch(range(first, first + BATCH)).tokens
        unused_rows = PADDED - len(torch.unique(tokens))
        assert result.num_zeros == HIDDEN * (unused_rows + PADDED - VOCAB)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_norm_and_zeros_are_layout_invariant(one_rank, layout) -> None:
    reference, _, _ = one_rank
    results = run_distributed(train_with_flags, 2, BASE + MEASURES + LAYOUTS[layout])[0][0]
    assert [r.num_zeros for r in results] == [r.num_zeros for r in reference]
    assert [r.params_norm for r in results] == pytest.approx(
        [r.params_norm for r in reference], rel=1e-5
    )


def _scalars(directory: Path) -> EventAccumulator:
    (events,) = directory.glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_and_pytorch_profiler_trace(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    flags = BASE + MEASURES + [
        "--train-iters", "3", "--tensorboard-dir", str(tb), "--log-memory-to-tensorboard",
        "--log-world-size-to-tensorboard", "--profile", "--use-pytorch-profiler",
        "--profile-step-start", "2", "--profile-step-end", "3", "--profile-ranks", "1",
    ]  # fmt: skip
    results = run_distributed(train_with_flags, 2, flags)[0][0]
    acc = _scalars(tb)
    tags = set(acc.Tags()["scalars"])
    for tag in ("params-norm", "num-zeros", "world-size"):
        assert {tag, f"{tag} vs samples"} <= tags
    assert {"mem-rss-bytes", "mem-max-rss-bytes"} <= tags  # the CPU's names
    assert not tags & {"mem-allocated-bytes", "mem-reserved-bytes"}  # the allocator's: CUDA
    assert [(e.step, e.value) for e in acc.Scalars("world-size")] == [(1, 2), (2, 2), (3, 2)]
    norms = [e.value for e in acc.Scalars("params-norm")]
    assert norms == pytest.approx([r.params_norm for r in results], rel=1e-6)
    assert [e.value for e in acc.Scalars("num-zeros")] == [r.num_zeros for r in results]
    rss, peak = acc.Scalars("mem-rss-bytes"), acc.Scalars("mem-max-rss-bytes")
    assert all(0 < a.value <= b.value for a, b in zip(rss, peak))

    traces = sorted(tb.glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank1"]  # only the listed rank
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "iteration 2" in names  # the profiled step, and no other
    assert not names & {"iteration 1", "iteration 3"}
    assert sum(e.get("ph") == "X" for e in events) > 100  # the step's operators are there


def test_profile_without_the_pytorch_profiler_on_cpu_is_one_note() -> None:
    configs = parse_args(BASE + ["--profile"], 1)
    profiler, note = profiler_for(configs.logging, 0, torch.device("cpu"), 1)
    assert profiler is None
    assert "nothing to capture without CUDA" in note and "--use-pytorch-profiler" in note
    quiet = parse_args(BASE + ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "x"], 1)
    assert profiler_for(quiet.logging, 1, torch.device("cpu"), 1) == (None, None)  # not listed


def _wandb_records(path: Path):
    """The protobuf records of a `.wandb` transaction log (LevelDB's log format: 32 KiB blocks
    of chunks with a 7-byte header: crc32c, length, type full/first/middle/last), parsed with
    wandb's own `Record` message."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks = path.read_bytes(), 32768, 7, []  # 7: the file's header
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def test_wandb_offline_run_holds_the_logged_losses(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    flags = BASE + ["--log-params-norm", "--wandb-project", "megapipe-test",
                    "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path)]  # fmt: skip
    results, stdout = run_distributed(train_with_flags, 1, flags)[0]
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history, runs = {}, []
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[record.history.step.num] = items
        elif kind == "run":
            runs.append(record.run)
    assert [(r.project, r.display_name) for r in runs][:1] == [("megapipe-test", "tiny")]
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["hidden_size"] == str(HIDDEN)  # the run's arguments, as TensorBoard's texts
    printed = re.findall(r"\| lm loss: (\S+) \|", stdout)
    assert [f"{history[i]['lm loss']:.6E}" for i in (1, 2)] == printed
    assert [history[i]["lm loss"] for i in (1, 2)] == pytest.approx([r.lm_loss for r in results])
    assert [history[i]["params-norm"] for i in (1, 2)] == [r.params_norm for r in results]
    assert [history[i]["samples vs steps"] for i in (1, 2)] == [BATCH, 2 * BATCH]


def test_wandb_project_without_the_package_says_pip_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec: not installed
    with pytest.raises(ConfigError) as error:
        parse_args(BASE + ["--wandb-project", "p", "--wandb-exp-name", "e"], 1)
    assert str(error.value) == "--wandb-project p needs the wandb package: pip install wandb"


@pytest.mark.parametrize(
    ("flags", "note"),
    [(["--use-pytorch-profiler"], "--use-pytorch-profiler has no effect without --profile"),
     (["--wandb-exp-name", "e"], "--wandb-exp-name has no effect without --wandb-project")],
)  # fmt: skip
def test_qualifying_flags_alone_are_noted(flags, note) -> None:
    with pytest.warns(UserWarning, match=note):
        configs = parse_args(BASE + flags, 1)
    assert note in configs.warnings


def test_nsys_window_on_cuda_marks_the_profiled_iterations(monkeypatch) -> None:
    """Without --use-pytorch-profiler on a GPU: cudaProfilerStart before iteration start,
    Stop after iteration end - 1, autograd's NVTX ranges on between, one range per iteration
    (the CUDA calls recorded here, so that it runs on a CPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"+{name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("-"))

    @contextlib.contextmanager
    def emit_nvtx(record_shapes: bool):
        calls.append(f"nvtx on (shapes {record_shapes})")
        yield
        calls.append("nvtx off")

    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", emit_nvtx)
    configs = parse_args(BASE + ["--profile", "--profile-step-start", "2",
                                 "--profile-step-end", "4"], 1)  # fmt: skip
    profiler, note = profiler_for(configs.logging, 0, torch.device("cuda"), 1)
    assert note is None
    for iteration in range(1, 6):
        profiler.begin(iteration)
        calls.append(f"step {iteration}")
        profiler.end(iteration)
    profiler.close()
    assert calls == [
        "step 1",
        "start", "nvtx on (shapes True)", "+iteration 2", "step 2", "-",
        "+iteration 3", "step 3", "-", "nvtx off", "stop",
        "step 4", "step 5",
    ]  # fmt: skip
