"""Timelines: boxes from the simulator and from a real trace, and tools/plot_schedule.py's PNG."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (imported once here so forked ranks inherit it)

from megapipe.arguments import parse_args
from megapipe.parallel import ParallelState
from megapipe.pipeline.schedules import Comm, Compute, build_schedule
from megapipe.pipeline.simulator import simulate_kind
from megapipe.pipeline.timeline import (
    TraceFormatError,
    boxes_from_simulation,
    boxes_from_trace,
    measured_timeline,
    replayed_makespan,
    simulated_timeline,
    trace_steps,
)
from megapipe.testing import run_distributed, train_with_flags
from megapipe.training import train

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
M = 4  # micro-batches of the traced run: global batch 8 / micro-batch 2
TRACED = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "256",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--lr", "3e-3",
    "--log-interval", "1", "--pipeline-model-parallel-size", "2",
    "--num-layers-per-virtual-pipeline-stage", "1",
]  # fmt: skip


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_schedule", ROOT / "tools/plot_schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "kind,p,v,m",
    [("1f1b", 4, 1, 8), ("gpipe", 2, 1, 3), ("interleaved-1f1b", 4, 2, 8), ("1f1b", 4, 1, 2),
     ("zero-bubble-h1", 4, 1, 8), ("interleaved-zero-bubble", 2, 2, 4)],
)  # fmt: skip
def test_simulated_boxes_cover_every_chunk_once_without_overlap(kind, p, v, m) -> None:
    boxes = boxes_from_simulation(simulate_kind(kind, p, v, m))
    phases = "FBW" if "zero-bubble" in kind else "FB"
    expected = sorted((ph, i, c) for ph in phases for i in range(m) for c in range(v))
    for rank in range(p):
        row = sorted((b for b in boxes if b.rank == rank), key=lambda b: b.start)
        assert sorted((b.kind, b.microbatch, b.chunk) for b in row) == expected
        assert all(b.duration > 0 for b in row)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(row, row[1:]))


def test_simulated_timeline_title_states_the_bubble() -> None:
    timeline = simulated_timeline("interleaved-1f1b", 4, 2, 8)
    assert "p=4, v=2, m=8" in timeline.title
    assert "bubble 18.8%" in timeline.title  # (p-1)/(v*m) = 3/16
    assert timeline.boxes[0].label(timeline.num_chunks).count(".") == 1  # "3.1" labels


def _train_with_trace(rank: int, world_size: int, path: str) -> None:
    configs = parse_args(TRACED + ["--pipeline-trace", path], world_size)
    state = ParallelState.build(1, configs.parallel.pipeline_model_parallel_size)
    with contextlib.redirect_stdout(io.StringIO()):
        train(configs, state)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trace of a real 2-rank interleaved (v=2) run of two iterations."""
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    run_distributed(_train_with_trace, 2, str(path), timeout=120)
    return path


def test_trace_is_a_chrome_trace(trace_path: Path) -> None:
    document = json.loads(trace_path.read_text())
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert events and all(isinstance(e["ts"], float | int) for e in events)
    assert all(e["dur"] >= 0 and e["tid"] in (0, 1) for e in events)
    assert {e["cat"] for e in events} == {"forward", "backward", "comm"}
    assert document["otherData"]["schedule"] == "interleaved-1f1b"


def test_trace_boxes_hold_every_action_of_every_traced_step(trace_path: Path) -> None:
    document = json.loads(trace_path.read_text())
    assert trace_steps(document) == [1, 2]
    for step in (1, 2):
        boxes = boxes_from_trace(document, step)
        assert all(b.duration > 0 for b in boxes)
        for rank in (0, 1):
            # receives posted ahead: pretrain_gpt's default (--overlap-p2p-communication)
            actions = build_schedule("interleaved-1f1b", 2, 2, M, rank, post_ahead=True)
            row = [b for b in boxes if b.rank == rank]
            computes = [(b.kind, b.microbatch, b.chunk) for b in row if b.kind != "comm"]
            expected = [(a.phase, a.microbatch, a.chunk) for a in actions if isinstance(a, Compute)]
            assert computes == expected  # every compute, in schedule order
            names = {
                e["name"]
                for e in document["traceEvents"]
                if e["ph"] == "X" and e["tid"] == rank and e["args"]["step"] == step
            }
            # Every transfer batch is there (receive waits are recorded as events of their own).
            assert {str(a) for a in actions if isinstance(a, Comm)} <= names
            starts = [b.start for b in row]  # recorded one after another
            assert starts == sorted(starts)
    timeline = measured_timeline(document)
    assert "interleaved-1f1b, p=2, v=2, m=4 (measured, iteration 2" in timeline.title
    # the same computes, replayed through the schedule with free transfers, cannot take longer
    # than the measured step: every measured start already respects the same dependencies
    assert document["otherData"]["receives_ahead"] is True
    replayed = replayed_makespan(timeline, "interleaved-1f1b", True)
    assert 0 < replayed <= timeline.makespan + 1e-6
    assert f"these computes with free transfers: {replayed:.0f} ms" in timeline.title
    assert replayed_makespan(timeline, "pipeline", True) is None  # an unknown schedule
    with pytest.raises(TraceFormatError, match=r"no step 7; it recorded steps \[1, 2\]"):
        boxes_from_trace(document, 7)


def test_cli_writes_png_from_simulation_and_trace(tmp_path: Path, trace_path: Path) -> None:
    tool = _load_tool()
    simulated, measured = tmp_path / "sim.png", tmp_path / "measured.png"
    with contextlib.redirect_stdout(io.StringIO()):
        assert tool.main(["--schedule", "1f1b", "--pp", "2", "--output", str(simulated)]) == 0
        assert tool.main(["--trace", str(trace_path), "--output", str(measured)]) == 0
    for png in (simulated, measured):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_cli_prints_the_simulated_bubble_of_a_zero_bubble_schedule(tmp_path: Path) -> None:
    tool = _load_tool()
    png = tmp_path / "zb.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["--schedule", "zero-bubble-h1", "--pp", "4", "--microbatches", "8"]
        assert tool.main(argv + ["--output", str(png)]) == 0
    # (p - 1) / (3m) = 3/24: a third of 1F1B's 37.5%
    assert "bubble 12.5% of compute time" in out.getvalue()
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "bubble 12.5% of compute time" in simulated_timeline("zero-bubble-h1", 4, 1, 8).title


def test_cli_errors_are_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    tool = _load_tool()
    out = str(tmp_path / "x.png")
    bad = ["--schedule", "interleaved-1f1b", "--pp", "4", "--vp", "2", "--microbatches", "6"]
    assert tool.main(bad + ["--output", out]) == 1
    (tmp_path / "t.json").write_text("{}")
    assert tool.main(["--trace", str(tmp_path / "t.json"), "--output", out]) == 1
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    assert tool.main(["--schedule", "1f1b", "--output", out]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("plot_schedule.py: error: ") for line in lines)
    assert (
        "multiple of --pp (4)" in lines[0]
        and "Use 4 or 8 micro-batches (--microbatches)" in lines[0]
    )
    assert "no traceEvents" in lines[1] and "matplotlib is not installed" in lines[2]
    assert not (tmp_path / "x.png").exists()


def test_cli_errors_name_the_tools_own_flags_and_refuse_unknown_suffixes(tmp_path, capsys):
    tool = _load_tool()
    assert tool.main(["--schedule", "interleaved-1f1b", "--output", str(tmp_path / "x.png")]) == 1
    assert tool.main(["--schedule", "1f1b", "--output", str(tmp_path / "x.foo")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        "plot_schedule.py: error: --schedule interleaved-1f1b needs --vp 2 or more "
        "(model chunks per rank)"
    )
    assert lines[1].startswith(f"plot_schedule.py: error: --output {tmp_path / 'x.foo'}: ")
    assert "matplotlib writes no .foo files; use one of" in lines[1] and ".svg" in lines[1]
    assert len(lines) == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "magic"), [("x.jpg", b"\xff\xd8\xff"), ("x.svg", b"<?xml")])
def test_the_picture_is_in_the_format_its_suffix_names(name, magic, tmp_path) -> None:
    assert (
        _load_tool().main(["--schedule", "1f1b", "--pp", "2", "--output", str(tmp_path / name)])
        == 0
    )
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_a_context_parallel_trace_names_each_computes_cp_peers(tmp_path: Path) -> None:
    """CP2 x PP2 (rank order tp-cp-dp-pp): global rank 0's pipeline is ranks 0 and 2; each
    compute event carries its rank's CP group (0 with 1, 2 with 3), the metadata the CP size."""
    path = tmp_path / "cp_trace.json"
    argv = TRACED + ["--context-parallel-size", "2", "--attention-dropout", "0",
                     "--eval-iters", "0", "--pipeline-trace", str(path)]  # fmt: skip
    run_distributed(train_with_flags, 4, argv, timeout=120)
    document = json.loads(path.read_text())
    computes = [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] != "comm"]
    peers = {e["tid"]: (e["args"]["global_rank"], e["args"]["cp_ranks"]) for e in computes}
    assert peers == {0: (0, [0, 1]), 1: (2, [2, 3])}
    assert document["otherData"]["context_parallel_size"] == 2
