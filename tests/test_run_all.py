"""benchmarks/run_all.py's report: headlines read from the benchmarks' JSON, verdicts against
targets, the generated section replaced in place with the hand-written text around it kept, a
failed benchmark reported instead of hidden, and real PNG plots. (The benchmarks themselves
are not run here: each has its own harness test or quick mode.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def run_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_all", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    # The report's files go to a scratch copy of benchmarks/, never the repository's.
    monkeypatch.setattr(module, "OUT", tmp_path / "out")
    monkeypatch.setattr(module, "PLOTS", tmp_path / "plots")
    monkeypatch.setattr(module, "RESULTS", tmp_path / "RESULTS.md")
    (tmp_path / "out").mkdir()
    return module


def _write(run_all, name: str, data: dict) -> None:
    (run_all.OUT / f"run_all_{name}.json").write_text(json.dumps(data))


def test_headlines_and_verdicts_come_from_each_benchmarks_json(run_all) -> None:
    _write(run_all, "step", {"median_ratio": 1.01, "target": 1.03})
    _write(run_all, "step_h512", {"median_ratio": 1.05, "target": 1.03, "config": {"hidden": 512}})
    layouts = [{"layout": "TP1", "median_ratio": 0.75}, {"layout": "TP2", "median_ratio": 0.91}]
    _write(run_all, "megatron_core", {"target": 0.8, "layouts": layouts})
    _write(run_all, "pipeline", {"variants": {
        "megapipe-1f1b": {"of_bound": 0.97, "ratio_to_torch": 0.98, "ratio_to_torch_1f1b": 0.98},
        "megapipe-zero-bubble-h1": {"of_bound": 0.9, "ratio_to_torch_1f1b": 0.85,
                                    "diagnosis": {"traced_over_replay": 1.25}},
        "torch-1f1b": {"of_bound": 0.92}}})  # fmt: skip
    headlines, problems = run_all.collect({})
    got = {(h.benchmark, h.what): (round(h.ratio, 3), h.verdict) for h in headlines}
    steps = {w: v for (b, w), v in got.items() if b == "bench_step"}
    assert list(steps.values()) == [(1.01, "met"), (1.05, "")]  # the wider model: no target
    assert "hidden 512" in list(steps)[1] and "hidden" not in list(steps)[0]
    mcore = [v for (b, _), v in got.items() if b == "bench_megatron_core"]
    assert mcore == [(0.75, "met"), (0.91, "NOT met")]
    pipeline = {w: v for (b, w), v in got.items() if b == "bench_pipeline"}
    assert pipeline["megapipe-1f1b: efficiency / schedule bound"] == (0.97, "met")
    assert pipeline["megapipe-zero-bubble-h1: efficiency / schedule bound"] == (0.9, "NOT met")
    assert pipeline["megapipe-zero-bubble-h1 / torch's 1F1B"] == (0.85, "met")
    replay = "megapipe-zero-bubble-h1: replay of its traced computes (free transfers) / traced step"
    assert pipeline[replay] == (0.8, "NOT met")  # 1 / 1.25, a floor of 0.95
    assert not any("replay" in w for w in pipeline if w.startswith("megapipe-1f1b"))
    assert not any(w.startswith("torch-") for w in pipeline)  # torch's rows are the baseline
    assert [p.split(":")[0] for p in problems] == [
        "pipeline_m4", "data_parallel", "fsdp", "planner"]  # no JSON yet  # fmt: skip
    _write(run_all, "pipeline_m4", {"config": {"microbatches": 4}, "variants": {
        "megapipe-zero-bubble-ahead": {"of_bound": 0.93, "ratio_to_torch_1f1b": 0.89},
        "megapipe-interleaved-zb-ahead": {"ratio_to_torch_1f1b": 0.91},
        "megapipe-1f1b": {"ratio_to_torch_1f1b": 0.97}}})  # fmt: skip
    headlines, _ = run_all.collect({})
    few = {h.what: (h.ratio, h.verdict) for h in headlines if h.what.startswith("m=4: ")}
    assert few == {  # only the zero-bubble kinds against torch's 1F1B
        "m=4: megapipe-zero-bubble-ahead / torch's 1F1B": (0.89, "met"),
        "m=4: megapipe-interleaved-zb-ahead / torch's 1F1B": (0.91, "NOT met"),
    }


def test_fsdp_comparisons_plain_fsdp2_judged_the_rest_informational(run_all) -> None:
    comparisons = [
        {"what": "megapipe ZeRO-3 / plain PyTorch FSDP2", "median_ratio": 1.07,
         "median_cpu_ratio": 0.99, "target": 1.05},
        {"what": "megapipe ZeRO-3 / megapipe ZeRO-1", "median_ratio": 1.6,
         "median_cpu_ratio": 1.4, "target": None},
    ]  # fmt: skip
    _write(run_all, "fsdp", {"comparisons": comparisons})
    headlines, _ = run_all.collect({})
    got = [(h.what, h.ratio, h.verdict) for h in headlines if h.benchmark == "bench_fsdp"]
    assert got == [
        ("DP=2 step, megapipe ZeRO-3 / plain PyTorch FSDP2", 1.07, "NOT met"),
        ("DP=2 step, megapipe ZeRO-3 / plain PyTorch FSDP2 (CPU time)", 0.99, ""),
        ("DP=2 step, megapipe ZeRO-3 / megapipe ZeRO-1", 1.6, ""),
    ]


def test_a_failed_or_reshaped_benchmark_is_reported_not_hidden(run_all) -> None:
    _write(run_all, "step", {"unexpected": 1})
    runs = {"pipeline": {"status": "timed out after 240 s", "seconds": 240.0}}
    headlines, problems = run_all.collect(runs)
    assert headlines == []
    assert "step: its JSON lacks 'median_ratio' (format changed?)" in problems
    assert "pipeline: timed out after 240 s" in problems


def test_the_section_is_replaced_in_place_and_the_rest_kept(run_all) -> None:
    run_all.RESULTS.write_text("# Benchmark results\n\nhand-written intro\n\n## bench_x\nnotes\n")
    first = run_all.section([run_all.Headline("bench_step", "a", 1.5, 1.03)], [], {}, [])
    run_all.write_section(first)
    text = run_all.RESULTS.read_text()
    assert text.startswith("# Benchmark results\n\n" + run_all.BEGIN)
    assert "| bench_step | a | 1.500 | <= 1.03 | NOT met |" in text
    second = run_all.section([run_all.Headline("bench_step", "a", 0.9, 1.03)], [], {}, [])
    run_all.write_section(second)
    text = run_all.RESULTS.read_text()
    assert text.count(run_all.BEGIN) == 1 and "1.500" not in text and "0.900" in text
    assert text.endswith("hand-written intro\n\n## bench_x\nnotes\n")


def test_a_rebuilt_report_says_when_its_numbers_were_measured(run_all) -> None:
    """--report-only after runs: the run times and finish times of the recorded runs, not a
    fresh "Generated" line that would pass for a new measurement."""
    first = {"status": "ok", "seconds": 12.0, "finished": "2026-12-01T10:00+00:00", "output": "x"}
    run_all.remember({"step": first})
    later = {"status": "ok", "seconds": 30.0, "finished": "2026-12-01T11:00+00:00", "output": ""}
    run_all.remember({"pipeline": later})  # a later --only run adds to the record
    recorded = run_all.recorded_runs()
    assert set(recorded) == {"step", "pipeline"} and "output" not in recorded["step"]
    text = run_all.section([], [], recorded, [], rebuilt=True)
    assert "Rebuilt " in text and "Generated" not in text
    assert "measured 2026-12-01T10:00+00:00 to 2026-12-01T11:00+00:00" in text
    assert "Run time: 42 s (step 12 s, pipeline 30 s)." in text
    assert "Generated " in run_all.section([], [], {"step": first}, [])


def test_plots_are_real_pngs_one_per_benchmark(run_all) -> None:
    headlines = [
        run_all.Headline("bench_step", "a", 1.01, 1.03),
        run_all.Headline("bench_pipeline", "b", 0.97, 0.95, higher=True),
        run_all.Headline("bench_pipeline", "c", 0.9, None),
    ]
    paths = run_all.plot(headlines)
    assert [p.name for p in paths] == ["bench_step.png", "bench_pipeline.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_per_rank_rows_are_judged_against_each_strategys_formula(run_all) -> None:
    zero1 = {"dtype": "bf16", "strategy": "optim", "distributed_optimizer": True, "dp": 2}
    zero3 = {"dtype": "fp32", "strategy": "optim_grads_params", "distributed_optimizer": False}
    memory = [
        {**zero1, "measured_total": 12.004, "formula_total": 12.0, "gathered_measured": 0.0,
         "measured_peak": 12.004, "formula_peak": 12.0},
        {**zero1, "dp": 4, "measured_total": 10.5, "formula_total": 9.0, "gathered_measured": 0.0,
         "measured_peak": 10.5, "formula_peak": 9.0},  # a leak: 1.17
        {**zero3, "dp": 4, "measured_total": 4.0, "formula_total": 4.0, "gathered_measured": 2.5,
         "measured_peak": 6.5, "formula_peak": 6.5},
        # a row written before the strategies: Megatron's table, distributed_optimizer only
        {"dtype": "fp32", "distributed_optimizer": False, "dp": 1, "measured_total": 16.0,
         "megatron_total": 16.0},
    ]  # fmt: skip
    timing = {"summary": {"ddp": {}, "megapipe": {"median_ratio": 1.02}}}
    _write(run_all, "data_parallel", {"timing": timing, "memory": memory})
    headlines, _ = run_all.collect({})
    rows = [h for h in headlines if h.benchmark == "memory per rank"]
    assert [(round(h.ratio, 4), h.verdict) for h in rows] == [
        (1.0003, "met"), (1.1667, "NOT met"), (1.0, "met"), (1.0, "met")]  # fmt: skip
    assert "bf16 optim (ZeRO-1), DP=4: 10.50 B/param at rest, measured / formula 9" in rows[1].what
    assert "fp32 optim_grads_params (ZeRO-3), DP=4: 4.00 B/param at rest + 2.50 gathered" in (
        rows[2].what)  # fmt: skip
    assert "fp32 no_shard (DDP), DP=1" in rows[3].what
    assert [p.name for p in run_all.plot(rows)] == ["memory_per_rank.png"]
