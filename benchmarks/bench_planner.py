"""The layout planner (tools/plan.py) against measurements and published figures.

1. --cpu: measured CPU runs of a small GPT (pretrain_gpt.py, gloo, one thread per rank) at
   1 rank, TP2, PP2, DP2, DP2 under ZeRO-3 (--use-torch-fsdp2: each layer's parameters
   all-gathered twice and its gradients reduce-scattered every micro-batch) and CP2 (the
   p2p ring over half of each sequence, gradients all-reduced over CP), two alternating
   rounds each. A CPU cluster preset is measured
   first: the peak FLOP/s of a 1024^3 fp32 matmul on one thread, the bandwidth of a 16 MiB
   gloo all-reduce between two forked ranks and the fixed cost of a collective inside a step
   (an all-reduce of one activation issued after compute, less its bytes at that bandwidth).
   The matmul efficiency is calibrated on the 1-rank run (its measured step time against the
   planner's compute term); the other layouts are predictions. Step time: the fastest
   `elapsed time per iteration` of iterations 3..N over the rounds (the least disturbed one:
   the machine is shared; the median is in the JSON).
   Memory: the peak RSS of the largest rank over the whole run (getrusage of the launcher's
   children) minus the process baseline (the same run of a 1-layer, hidden 64 model, less its
   own estimate), against the planner's bytes per GPU; PP runs also print the exact peak of
   saved activations per stage, compared with the planner's activation term.
2. --published: Megatron-LM's weak-scaling table (Narayanan et al. 2021, arXiv 2104.04473,
   Table 1: GPT 1.7B to 1T on DGX A100s). For every row the planner searches twice: with the
   features Megatron-LM had in 2021 (full recomputation, 1F1B or interleaved, no distributed
   optimizer, as the paper ran) and with everything megapipe has. Reported: the top layout's
   (TP, PP), where Megatron's (TP, PP) ranks and its estimated time, and the estimated TFLOP/s
   per GPU in the paper's accounting (its equation (3), which counts the recomputed forward:
   96 B s l h^2 (1 + s/6h + V/16lh)) against the published one. The efficiency is calibrated
   on the first row (1.7B, TP1 PP1 DP32, 137 TFLOP/s); the other nine are predictions.

    python benchmarks/bench_planner.py              # both, ~10 min on 2 busy cores
    python benchmarks/bench_planner.py --cpu        # ~7 min (updates only its part of the JSON)
    python benchmarks/bench_planner.py --published  # ~3 min
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from megapipe.atomic_files import write_json
from megapipe.config import ModelConfig
from megapipe.planning.cluster import GIB, PRESETS, Cluster
from megapipe.planning.layout import Layout
from megapipe.planning.memory import layout_memory
from megapipe.planning.presets import MEGATRON_WEAK_SCALING, PublishedRun
from megapipe.planning.search import PlanOptions, plan
from megapipe.planning.time_model import TimeKnobs, step_time
from megapipe.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024.0 * 1024.0

# ---------------------------------------------------------------------------------------------
# 1. CPU runs


def measure_peak_tflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` fp32 matmul rate on one thread, TFLOP/s."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def _all_reduce_times(
    rank: int, world: int, nbytes: int, repeats: int, after_compute: bool
) -> list[float]:
    """Seconds of `repeats` all-reduces of `nbytes` (after one untimed), each issued after a
    barrier, or after two small matmuls on every rank as a training step issues its TP
    collectives (on gloo the latter are about 3x slower: its threads have gone to sleep)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, a, b = torch.ones(nbytes // 4), torch.randn(256, 384), torch.randn(384, 1152)
    dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        if after_compute:
            (a @ b) @ b.t()
        else:
            dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return times


def measure_bandwidth_gbps(nbytes: int = 16 * 1024 * 1024, repeats: int = 5) -> float:
    """The ring bandwidth a 2-rank gloo all-reduce achieves: 2 (n-1)/n x bytes / time."""
    per_rank = run_distributed(_all_reduce_times, 2, nbytes, repeats, False)
    seconds = max(min(times) for times in per_rank)
    return 2 * (2 - 1) / 2 * nbytes / seconds / 1e9


def _collective_times(rank: int, world: int, nbytes: int, repeats: int) -> dict[str, float]:
    """The fastest of `repeats` all-reduces, all-gathers and reduce-scatters of `nbytes`."""
    import torch.distributed as dist

    from megapipe.parallel.mappings import all_gather_single, reduce_scatter_single

    torch.set_num_threads(1)
    full, shard = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather_single(full, shard, group=None),
        "reduce_scatter": lambda: reduce_scatter_single(shard, full, group=None),
    }
    best = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return best


def measure_shard_efficiency(nbytes: int = 16 * 1024 * 1024, repeats: int = 5) -> float:
    """How much of an all-reduce's ring bandwidth gloo's all-gather and reduce-scatter reach
    (the ring moves half the bytes of an all-reduce in each; 1.0 = as fast per byte)."""
    per_rank = run_distributed(_collective_times, 2, nbytes, repeats)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    shard = (worst["all_gather"] + worst["reduce_scatter"]) / 2
    return min(1.0, (worst["all_reduce"] / 2) / shard)


def measure_memory_gbps(nbytes: int = 64 * 1024 * 1024, repeats: int = 5) -> float:
    """This CPU's copy bandwidth, one thread: bytes read + written by a `copy_` of `nbytes`
    (what FSDP2's buffer copies cost; `Cluster.memory_gbps`)."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def measure_latency_us(nbytes: int, gbps: float, repeats: int = 40) -> float:
    """The fixed cost of one collective inside a step: the median all-reduce of `nbytes` after
    compute, less its bytes at the bandwidth (2 (n-1)/n x bytes / `gbps`, n = 2), in us."""
    per_rank = run_distributed(_all_reduce_times, 2, nbytes, repeats, True)
    seconds = max(statistics.median(times) for times in per_rank)
    return max(0.0, seconds - nbytes / (gbps * 1e9)) * 1e6


CPU_MODEL = dict(layers=4, hidden=384, heads=4, seq=128, vocab=2048)
BASELINE_MODEL = dict(layers=1, hidden=64, heads=4, seq=128, vocab=128)
MICRO_BATCH, GLOBAL_BATCH, ITERS, ROUNDS = 2, 8, 8, 2
CPU_LAYOUTS = {  # name: (ranks, flags, Layout)
    "1 rank": (1, [], Layout(1, 1, 1, micro_batch=MICRO_BATCH)),
    "TP2": (2, ["--tensor-model-parallel-size", "2"], Layout(2, 1, 1, micro_batch=MICRO_BATCH)),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"], Layout(1, 2, 1, micro_batch=MICRO_BATCH)),
    "DP2": (2, [], Layout(1, 1, 2, micro_batch=MICRO_BATCH)),
    "ZeRO-3": (2, ["--use-torch-fsdp2"],  # DP2 on FSDP2: gathers twice and reduce-scatters
               Layout(1, 1, 2, micro_batch=MICRO_BATCH, sharding="optim_grads_params")),
    "CP2": (2, ["--context-parallel-size", "2"],  # the ring at S / 2, gradients over CP
            Layout(1, 1, 1, micro_batch=MICRO_BATCH, cp=2)),
}  # fmt: skip


def model_config(sizes: dict) -> ModelConfig:
    return ModelConfig(num_layers=sizes["layers"], hidden_size=sizes["hidden"],
                       num_attention_heads=sizes["heads"], vocab_size=sizes["vocab"],
                       seq_length=sizes["seq"], attention_dropout=0.0,
                       hidden_dropout=0.0)  # fmt: skip


def _flags(sizes: dict) -> list[str]:
    return [
        "--num-layers", str(sizes["layers"]), "--hidden-size", str(sizes["hidden"]),
        "--num-attention-heads", str(sizes["heads"]), "--seq-length", str(sizes["seq"]),
        "--max-position-embeddings", str(sizes["seq"]), "--vocab-size", str(sizes["vocab"]),
        "--mock-data", "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERS),
        "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-4",
        "--attention-dropout", "0", "--hidden-dropout", "0",
    ]  # fmt: skip


ELAPSED = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")
SAVED = re.compile(r"peak saved activations ([0-9.]+) MiB \(estimate ([0-9.]+) MiB\)")
# Runs the command and prints the peak RSS (KiB) of its largest process, workers included:
# getrusage(RUSAGE_CHILDREN) covers every reaped descendant (torchrun reaps its workers).
_PEAK_RSS = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "print('peak-rss-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
    "sys.exit(code)"
)


def run_pretrain(ranks: int, flags: list[str]) -> dict:
    """pretrain_gpt.py at `ranks` ranks: step times (ms) from iteration 3 on, the peak RSS of
    the largest rank over the whole run (MiB), the PP runs' measured saved activations."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "torch.distributed.run",
                "--standalone", "--nproc_per_node", str(ranks)]  # fmt: skip
    out = subprocess.run([*launcher, str(ROOT / "pretrain_gpt.py"), *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"pretrain_gpt.py failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.splitlines()
    times = {int(m[1]): float(m[2]) for line in lines if (m := ELAPSED.search(line))}
    peak = [int(line.split()[1]) for line in lines if line.startswith("peak-rss-kib")]
    saved = [float(m[1]) for line in lines if (m := SAVED.search(line))]
    return {"step_ms": [times[i] for i in sorted(times) if i >= 3], "peak_rss_mib": peak[0] / 1024,
            "saved_activations_mib": saved}  # fmt: skip


def cpu_validation() -> dict:
    load_before = os.getloadavg()[0]
    peak = measure_peak_tflops()
    bandwidth = measure_bandwidth_gbps()
    activation = CPU_MODEL["seq"] * MICRO_BATCH * CPU_MODEL["hidden"] * 4  # fp32 s b h
    latency = measure_latency_us(activation, bandwidth)
    knobs = TimeKnobs(half_precision=False)
    memory_gbps, shard_efficiency = measure_memory_gbps(), measure_shard_efficiency()
    cluster = Cluster("CPU (measured)", gpus_per_node=4, nodes=1, memory_bytes=8 * GIB,
                      memory_gbps=memory_gbps, shard_collective_efficiency=shard_efficiency,
                      peak_tflops=peak, intra_node_gbps=bandwidth, inter_node_gbps=bandwidth,
                      matmul_efficiency=1.0, collective_latency_us=latency)  # fmt: skip
    print(f"CPU preset: matmul {peak * 1e3:.1f} GFLOP/s (1 thread), copies {memory_gbps:.1f} "
          f"GB/s (read + write), reduce-scatter/all-gather at {shard_efficiency:.0%} of the "
          "all-reduce's ring bandwidth, gloo all-reduce "
          f"{bandwidth:.2f} GB/s, {latency:.0f} us per collective (an activation's all-reduce "
          "after compute, less its bytes)", flush=True)  # fmt: skip
    model, tiny = model_config(CPU_MODEL), model_config(BASELINE_MODEL)
    base_run = run_pretrain(1, _flags(BASELINE_MODEL))
    base_estimate = layout_memory(tiny, Layout(1, 1, 1, micro_batch=MICRO_BATCH), GLOBAL_BATCH,
                                  half_precision=False).total / MIB  # fmt: skip
    baseline = base_run["peak_rss_mib"] - base_estimate
    print(f"process baseline: {baseline:.1f} MiB (peak RSS of the 1-layer run less its "
          f"{base_estimate:.1f} MiB estimate)", flush=True)  # fmt: skip
    rows = {name: {"layout": layout, "runs": []} for name, (_, _, layout) in CPU_LAYOUTS.items()}
    for round_ in range(ROUNDS):  # alternating, so a busy spell does not hit one layout only
        for name, (ranks, extra, _) in CPU_LAYOUTS.items():
            run = run_pretrain(ranks, _flags(CPU_MODEL) + extra)
            rows[name]["runs"].append(run)
            print(f"  round {round_}: {name} {min(run['step_ms']):.1f} ms", flush=True)
    for row in rows.values():
        runs = row["runs"]
        row["measured"] = {
            "step_ms": [t for r in runs for t in r["step_ms"]],
            # a process the launcher fails to reap can only lower the peak: take the highest
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "saved_activations_mib": max((r["saved_activations_mib"] for r in runs), key=len),
        }
    one = step_time(model, CPU_LAYOUTS["1 rank"][2], cluster, GLOBAL_BATCH, knobs)
    measured_one = min(rows["1 rank"]["measured"]["step_ms"]) / 1e3
    efficiency = one.compute / (measured_one - (one.total - one.compute))
    cluster = dataclasses.replace(cluster, matmul_efficiency=efficiency)
    table = []
    for name, row in rows.items():
        layout, measured = row["layout"], row["measured"]
        estimate = step_time(model, layout, cluster, GLOBAL_BATCH, knobs)
        memory = layout_memory(model, layout, GLOBAL_BATCH, half_precision=False)
        step = min(measured["step_ms"])  # the least disturbed iteration on a shared machine
        rss = measured["peak_rss_mib"] - baseline
        entry = {
            "layout": name, "ranks": layout.world_size,
            "measured_step_ms": step, "estimated_step_ms": estimate.total * 1e3,
            "step_error": estimate.total * 1e3 / step - 1,
            "estimate_terms_ms": {k: v * 1e3 for k, v in estimate.terms().items()},
            "measured_model_mib": rss, "estimated_mib": memory.total / MIB,
            "memory_error": memory.total / MIB / rss - 1,
            "estimated_activations_mib": memory.activations / MIB,
            "measured_saved_activations_mib": measured["saved_activations_mib"],
            "step_ms_samples": measured["step_ms"],
            "step_ms_median": statistics.median(measured["step_ms"]),
        }  # fmt: skip
        table.append(entry)
    print(f"\nCPU: matmul efficiency calibrated on the 1-rank run: {efficiency:.1%} of the "
          f"1024^3 matmul rate\n")  # fmt: skip
    print(
        "layout | step ms measured | estimated | error | model memory MiB measured | "
        "estimated | error | saved activations MiB measured / estimated"
    )
    for e in table:
        saved = "/".join(f"{s:.2f}" for s in e["measured_saved_activations_mib"]) or "-"
        print(f"{e['layout']:6} | {e['measured_step_ms']:9.1f} | {e['estimated_step_ms']:9.1f} | "
              f"{e['step_error']:+6.1%} | {e['measured_model_mib']:8.1f} | "
              f"{e['estimated_mib']:8.1f} | {e['memory_error']:+6.1%} | {saved} / "
              f"{e['estimated_activations_mib']:.2f}")  # fmt: skip
    load = (load_before, os.getloadavg()[0])
    print(f"load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f} on "
          f"{os.cpu_count()} cores")  # fmt: skip
    return {"peak_tflops": peak, "allreduce_gbps": bandwidth, "memory_gbps": memory_gbps,
            "shard_collective_efficiency": shard_efficiency,
            "baseline_mib": baseline,
            "collective_latency_us": latency,
            "load_average": load,
            "matmul_efficiency": efficiency, "model": CPU_MODEL, "micro_batch": MICRO_BATCH,
            "global_batch": GLOBAL_BATCH, "rows": table}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 2. Megatron-LM's weak-scaling table


def paper_flops(run: PublishedRun) -> float:
    """Narayanan et al. 2021, equation (3): FLOPs of an iteration with full recomputation."""
    b, s, layers, h, v = run.batch, 2048, run.layers, run.hidden, 51200
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


MEGATRON_2021 = PlanOptions(recompute=("full",), sharding=("no_shard",),
                            schedules=("1f1b", "interleaved-1f1b"),
                            knobs=TimeKnobs(tp_weight_grad_overlap=False))  # fmt: skip
# The same, with the gradient all-reduce wholly hidden behind the backward: how much of the
# disagreement with Megatron's choices rests on the DP overlap assumption.
MEGATRON_2021_DP_HIDDEN = dataclasses.replace(
    MEGATRON_2021, knobs=dataclasses.replace(MEGATRON_2021.knobs, dp_overlap=1.0)
)
VARIANTS = {"2021": MEGATRON_2021, "2021, DP hidden": MEGATRON_2021_DP_HIDDEN,
            "megapipe": PlanOptions()}  # fmt: skip


def pair_rank(result, tp: int, pp: int) -> int | None:
    """Where (tp, pp)'s best layout ranks among the best layouts of each (TP, PP) pair."""
    pairs: list[tuple[int, int]] = []
    for entry in result.ranked:
        pair = (entry.layout.tp, entry.layout.pp)
        if pair not in pairs:
            pairs.append(pair)
    return pairs.index((tp, pp)) + 1 if (tp, pp) in pairs else None


def _cluster(run: PublishedRun, efficiency: float) -> Cluster:
    return PRESETS["dgx-a100"].with_(nodes=run.gpus // 8, matmul_efficiency=efficiency)


def _megatron_layout(result, run: PublishedRun):
    return result.position(lambda x: (x.tp, x.pp) == (run.tp, run.pp))


def calibrate(run: PublishedRun) -> float:
    """The efficiency at which Megatron's own layout of `run` reaches its published TFLOP/s."""
    result = plan(run.model, _cluster(run, 1.0), run.batch, MEGATRON_2021)
    found = _megatron_layout(result, run)
    assert found, "Megatron's layout of the calibration row must be feasible"
    t, beta = found[1].time, found[1].time.bubble_fraction
    target = paper_flops(run) / (run.tflops_per_gpu * 1e12 * run.gpus)
    # total(e) = compute/e (1 + beta) + TP (1 + beta) + PP + DP, solved for e
    return t.compute * (1 + beta) / (target - t.tp_comm * (1 + beta) - t.pp_comm - t.dp_comm)


def published_validation() -> dict:
    efficiency = calibrate(MEGATRON_WEAK_SCALING[0])
    print(f"\nmatmul efficiency calibrated on the 1.7B row: {efficiency:.1%} of 312 TFLOP/s\n")
    rows = []
    for run in MEGATRON_WEAK_SCALING:
        cluster = _cluster(run, efficiency)
        row = {"model": run.name, "gpus": run.gpus, "batch": run.batch,
               "published": {"tp": run.tp, "pp": run.pp, "tflops": run.tflops_per_gpu}}  # fmt: skip
        for variant, options in VARIANTS.items():
            start = time.perf_counter()
            result = plan(run.model, cluster, run.batch, options)
            top = result.ranked[0]
            found = _megatron_layout(result, run)
            entry = {
                "top": top.layout.describe(), "top_tp_pp": [top.layout.tp, top.layout.pp],
                "top_step_s": top.time.total, "top_terms_s": top.time.terms(),
                "top_paper_tflops": paper_flops(run) / (top.time.total * run.gpus * 1e12),
                "top_model_tflops": top.time.tflops_per_gpu,
                "top_memory_gib": top.memory.total / GIB,
                "feasible": len(result.ranked), "search_s": time.perf_counter() - start,
            }  # fmt: skip
            if found:
                rank, megatron = found
                entry.update({
                    "megatron_rank": rank, "megatron_layout": megatron.layout.describe(),
                    "megatron_pair_rank": pair_rank(result, run.tp, run.pp),
                    "megatron_step_s": megatron.time.total,
                    "megatron_terms_s": megatron.time.terms(),
                    "megatron_paper_tflops":
                        paper_flops(run) / (megatron.time.total * run.gpus * 1e12),
                    "megatron_memory_gib": megatron.memory.total / GIB,
                })  # fmt: skip
            else:
                reasons = {r.reason for r in result.rejected
                           if r.what.startswith(f"TP{run.tp} PP{run.pp} ")}  # fmt: skip
                entry["megatron_rejected"] = sorted(reasons)[:3]
            row[variant] = entry
        rows.append(row)
        old, hidden, new = row["2021"], row["2021, DP hidden"], row["megapipe"]
        print(f"{run.name:16} published TP{run.tp} PP{run.pp} {run.tflops_per_gpu:5.0f} | 2021: "
              f"top {old['top']} ({old['top_paper_tflops']:.0f}), Megatron's (TP, PP) "
              f"#{old.get('megatron_pair_rank', '-')} ({old.get('megatron_paper_tflops', 0):.0f})"
              f" | DP hidden: top TP{hidden['top_tp_pp'][0]} PP{hidden['top_tp_pp'][1]} | "
              f"megapipe: top {new['top']} ({new['top_model_tflops']:.0f} model TFLOP/s)",
              flush=True)  # fmt: skip
    return {"matmul_efficiency": efficiency, "rows": rows,
            "source": "Narayanan et al. 2021, arXiv 2104.04473, Table 1"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Only the CPU runs.")
    parser.add_argument("--published", action="store_true", help="Only the published table.")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "out" / "planner.json"))
    args = parser.parse_args()
    both = not (args.cpu or args.published)
    output = Path(args.output)
    report = json.loads(output.read_text()) if output.exists() else {}  # keep the other part
    report.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=platform.platform(), torch=torch.__version__)  # fmt: skip
    if args.cpu or both:
        report["cpu"] = cpu_validation()
    if args.published or both:
        report["published"] = published_validation()
    write_json(args.output, report)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
