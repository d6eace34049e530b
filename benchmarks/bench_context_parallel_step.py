"""The whole training step under context parallelism: CP=2 on 2 ranks against CP=1 on 1 rank.

Two gloo ranks (forked, one thread each). One timed step is `pretrain_gpt.py`'s iteration
(`Stepper.step`: the mock-data reader, the executor's forward and backward, the gradient
reduction over DP x CP, the loss, the optimizer's norm, clipping and AdamW step) of a small
GPT (rope, fp32, no dropout) on one global batch of --micro-batches sequences of --seq tokens:

* `cp1`: the model on one rank (`ParallelState.single()`), each rank running its own copy at
  once (the single-rank baseline; both cores are busy either way, as in
  bench_context_parallel.py);
* `cp2-p2p`, `cp2-all_gather`, `cp2-a2a`: the same run at `--context-parallel-size 2
  --cp-comm-type X`, each rank holding two of the 4 chunks of every sequence. The ring's
  overlap (`context_parallel_attention(overlap=...)`) has no flag, so p2p runs as the product
  does, overlapped; bench_context_parallel.py times the attention alone without it.

A step's time is the slower rank's, from a barrier; the variants rotate over rounds
(`round_args.rotating_rounds`); a round's time is the median of its steps, and each ratio is
the median over rounds of the per-round ratio to `cp1`. Tokens/s per rank: the step's tokens
(micro-batches x seq) over its time and the ranks that share them (1 at CP1, 2 at CP2). Every
variant takes the same steps on the same batches from the same initial weights, so their
losses are compared with cp1's (fp32: a check that the timed runs compute the same thing).

    python benchmarks/bench_context_parallel_step.py          # ~3-4 minutes on 2 cores
    python benchmarks/bench_context_parallel_step.py --quick  # smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import (  # noqa: E402
    add_round_args,
    parse_round_args,
    rotating_rounds,
    run_record,
)

from megapipe.arguments import parse_args as parse_megatron_args  # noqa: E402
from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from megapipe.training.step_by_step import Stepper  # noqa: E402

DEFAULT_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "out", "context_parallel_step.json"
)
BASELINE = "cp1"
COMM_TYPES = ("p2p", "all_gather", "a2a")
CP = 2
LOSS_TOLERANCE = 1e-4  # relative, fp32, a few steps


def model_flags(args: argparse.Namespace, seq: int) -> list[str]:
    """pretrain_gpt.py's flags for the benchmark's model and batch (mock data, no dropout)."""
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq), "--vocab-size", str(args.vocab),
        "--micro-batch-size", "1", "--global-batch-size", str(args.micro_batches),
        "--mock-data", "--train-iters", "1000000", "--lr", "1e-4", "--clip-grad", "1.0",
        "--position-embedding-type", "rope", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--seed", str(args.seed), "--eval-iters", "0",
    ]  # fmt: skip


def variant_flags(name: str) -> list[str]:
    """The CP flags of a variant ("cp1" or "cp2-<comm type>")."""
    if name == BASELINE:
        return []
    return ["--context-parallel-size", str(CP), "--cp-comm-type", name.removeprefix("cp2-")]


def _stepper(flags: list[str], world: int, state: ParallelState) -> Stepper:
    with contextlib.redirect_stdout(io.StringIO()):
        return Stepper.build(parse_megatron_args(flags, world), state)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    single = ParallelState.single()
    cp_state = ParallelState.build(1, 1, context_parallel_size=CP)
    steps = {}
    for seq in args.seq_list:
        for name in args.variant_list:
            flags = model_flags(args, seq) + variant_flags(name)
            stepper = (
                _stepper(flags, 1, single) if name == BASELINE else _stepper(flags, CP, cp_state)
            )

            def step(stepper: Stepper = stepper) -> tuple[float, float]:
                result = stepper.step()
                return result.lm_loss, result.grad_norm

            steps[f"S={seq} {name}"] = step
    history, times = rotating_rounds(steps, args)
    return {"times": times, "history": history}


def summarize(args: argparse.Namespace, per_rank: list[dict]) -> dict:
    """Per variant: median step ms (slower rank) and process CPU ms (mean over ranks), their
    ratios to cp1, tokens/s per rank, the largest relative loss difference from cp1 over every
    step."""
    names = list(per_rank[0]["times"])
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in names:
            steps = [[rank["times"][name][r][s] for rank in per_rank] for s in range(args.steps)]
            row[name] = statistics.median(max(wall for wall, _ in ranks) for ranks in steps)
            row[f"{name} cpu"] = statistics.median(
                statistics.mean(cpu for _, cpu in ranks) for ranks in steps
            )
        rounds.append(row)

    def ratio(top: str, bottom: str) -> float:
        return statistics.median(row[top] / row[bottom] for row in rounds)

    summary = {}
    for name in names:
        seq, variant = name.split(" ", 1)
        baseline = f"{seq} {BASELINE}"
        ranks_sharing = 1 if variant == BASELINE else CP
        median_ms = statistics.median(row[name] for row in rounds)
        tokens = args.micro_batches * int(seq.removeprefix("S="))
        losses = [loss for loss, _ in per_rank[0]["history"][name]]
        reference = [loss for loss, _ in per_rank[0]["history"][baseline]]
        summary[name] = {
            "median_ms": median_ms,
            "best_ms": min(w for rank in per_rank for st in rank["times"][name] for w, _ in st),
            "median_cpu_ms": statistics.median(row[f"{name} cpu"] for row in rounds),
            "ratio_to_cp1": ratio(name, baseline),
            "cpu_ratio_to_cp1": ratio(f"{name} cpu", f"{baseline} cpu"),
            "tokens_per_s_per_rank": tokens / (median_ms / 1e3) / ranks_sharing,
            "max_rel_loss_diff_vs_cp1": max(abs(a - b) / abs(b) for a, b in zip(losses, reference)),
        }
    return {"rounds": rounds, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--micro-batches", type=int, default=1, help="sequences per step (mbs 1)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument(
        "--variants",
        default=",".join([BASELINE, *(f"cp2-{c}" for c in COMM_TYPES)]),
        help="comma-separated: cp1 and cp2-<comm type> (p2p, all_gather, a2a)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the distributed run")
    add_round_args(p, warmup=1, rounds=5, steps=2, default_json=DEFAULT_JSON)
    args = parse_round_args(p, argv)
    args.seq_list = [int(s) for s in args.seq.split(",")]
    args.variant_list = args.variants.split(",")
    allowed = {BASELINE, *(f"cp2-{c}" for c in COMM_TYPES)}
    if BASELINE not in args.variant_list or not set(args.variant_list) <= allowed:
        others = ", ".join(sorted(allowed - {BASELINE}))
        p.error(f"--variants {args.variants}: cp1 (the baseline), then any of {others}")
    if any(s % (2 * CP) for s in args.seq_list):
        p.error(f"--seq {args.seq}: each length must be a multiple of {2 * CP} (2 x CP)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(
        f"context-parallel training step benchmark: torch {torch.__version__}, CP={CP}, 2 ranks "
        f"x 1 thread (gloo), {platform.machine()} ({os.cpu_count()} cpus)"
    )
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = summarize(args, run_distributed(_rank, CP, args, timeout=args.timeout))
    print(
        f"one training step: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocab {args.vocab}, rope, fp32, {args.micro_batches} x micro-batch 1; {args.warmup} "
        f"warm-up steps, {args.rounds} rounds x {args.steps} steps, rotating; ms = slower rank, "
        "median of the round's steps; vs CP1: median over rounds of the per-round ratio\n"
    )
    print(f"{'variant':21} {'median ms':>9} {'best ms':>8} {'CPU ms':>8} {'vs CP1':>7} "
          f"{'CPU vs CP1':>10} {'tok/s/rank':>10} {'loss diff':>9}")  # fmt: skip
    for name, s in result["summary"].items():
        print(
            f"{name:21} {s['median_ms']:9.1f} {s['best_ms']:8.1f} {s['median_cpu_ms']:8.1f} "
            f"{s['ratio_to_cp1']:7.3f} {s['cpu_ratio_to_cp1']:10.3f} "
            f"{s['tokens_per_s_per_rank']:10.0f} {s['max_rel_loss_diff_vs_cp1']:9.1e}"
        )
    result["load_average_1min"] = {"start": load, "end": os.getloadavg()[0]}
    print(
        f"({time.perf_counter() - start:.0f} s; 1-minute load average {load:.1f} at the start, "
        f"{result['load_average_1min']['end']:.1f} at the end, on {os.cpu_count()} cpus)"
    )
    result.update(run_record("context_parallel_step", args))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    worst = max(s["max_rel_loss_diff_vs_cp1"] for s in result["summary"].values())
    if worst > LOSS_TOLERANCE:
        raise SystemExit(f"a CP2 run's losses differ from CP1's by {worst:.1e} (relative)")
    return result


if __name__ == "__main__":
    main()
