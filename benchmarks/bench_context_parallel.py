"""Context-parallel attention at CP=2 against plain attention on one rank: forward + backward.

Two gloo ranks (forked, one thread each). One timed step is one forward and backward of causal
attention over a sequence of --seq tokens ([b, heads, S, d] queries, GQA keys and values):

* `cp1-sdpa`: plain `scaled_dot_product_attention(is_causal=True)` over the whole sequence, on
  each rank alone (the single-rank baseline; both ranks run it at once, as both cores are
  there either way);
* `p2p`, `p2p-no-overlap`, `all_gather`, `a2a`: `context_parallel_attention` at CP=2, each rank
  holding its half of the sequence in the load-balanced layout (`p2p-no-overlap`: the ring
  waits for each K/V transfer before computing; `p2p-ref-blocks`: each block through the plain
  matmul/softmax reference instead of torch's CPU flash kernels).

A step's time is the slower rank's, from a barrier; the variants rotate over rounds
(`round_args.rotating_rounds`); a round's time is the median of its steps, and each ratio is
the median over rounds of the per-round ratio. Before timing, every CP variant's output and
gradients are checked against the single-rank ones (max abs difference, fp32).

    python benchmarks/bench_context_parallel.py          # ~1-2 minutes on 2 cores
    python benchmarks/bench_context_parallel.py --quick  # smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import (  # noqa: E402
    add_round_args,
    parse_round_args,
    rotating_rounds,
    run_record,
)

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.data.context_parallel_split import chunk_positions  # noqa: E402
from megapipe.model.context_parallel import context_parallel_attention  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402

DEFAULT_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "out", "context_parallel.json"
)
BASELINE = "cp1-sdpa"
CP_VARIANTS = {  # name: (comm_type, overlap, block_kernel)
    "p2p": ("p2p", True, "auto"),
    "p2p-no-overlap": ("p2p", False, "auto"),
    "p2p-ref-blocks": ("p2p", True, "reference"),
    "all_gather": ("all_gather", True, "auto"),
    "a2a": ("a2a", True, "auto"),
}
CP = 2
TOLERANCE = 1e-4  # fp32, long sequences


def _inputs(args: argparse.Namespace, seq: int):
    g = torch.Generator().manual_seed(args.seed + seq)
    q = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)
    k, v = (torch.randn(args.batch, args.groups, seq, args.head_dim, generator=g) for _ in "kv")
    dout = torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g)
    return q, k, v, dout


def _step_fn(name: str, args: argparse.Namespace, seq: int, rank: int, group):
    """A closure running one forward + backward, returning (output, dq, dk, dv)."""
    q, k, v, dout = _inputs(args, seq)
    scale = args.head_dim**-0.5
    if name == BASELINE:
        leaves = [x.requires_grad_() for x in (q, k, v)]

        def attend():
            return F.scaled_dot_product_attention(
                *leaves, is_causal=True, scale=scale, enable_gqa=args.groups != args.heads
            )
    else:
        idx = chunk_positions(seq, CP, rank)
        leaves = [x[:, :, idx].contiguous().requires_grad_() for x in (q, k, v)]
        dout = dout[:, :, idx].contiguous()
        comm_type, overlap, kernel = CP_VARIANTS[name]

        def attend():
            return context_parallel_attention(
                *leaves, group, comm_type=comm_type, scale=scale, overlap=overlap,
                block_kernel=kernel,
            )  # fmt: skip

    def step():
        out = attend()
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))

    return step


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD
    steps, errors = {}, {}
    for seq in args.seq_list:
        fns = {n: _step_fn(n, args, seq, rank, group) for n in (BASELINE, *CP_VARIANTS)}
        reference = fns[BASELINE]()
        idx = chunk_positions(seq, CP, rank)
        for name, fn in fns.items():
            label = f"S={seq} {name}"
            if name != BASELINE:
                got = fn()
                errors[label] = max(
                    float((a - b[:, :, idx]).abs().max()) for a, b in zip(got, reference)
                )

            def timed(fn=fn):
                fn()
                return 0.0, 0.0

            steps[label] = timed
    _, times = rotating_rounds(steps, args)
    return {"times": times, "errors": errors}


def summarize(args: argparse.Namespace, per_rank: list[dict]) -> dict:
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
        summary[name] = {
            "median_ms": statistics.median(row[name] for row in rounds),
            "best_ms": min(w for rank in per_rank for st in rank["times"][name] for w, _ in st),
            "median_cpu_ms": statistics.median(row[f"{name} cpu"] for row in rounds),
            "ratio_to_cp1": ratio(name, f"{seq} {BASELINE}"),
            "ratio_to_p2p": ratio(name, f"{seq} p2p"),
            "max_abs_diff_vs_cp1": max(rank["errors"].get(name, 0.0) for rank in per_rank),
        }
    return {"rounds": rounds, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the distributed run")
    add_round_args(p, warmup=1, rounds=6, steps=2, default_json=DEFAULT_JSON)
    args = parse_round_args(p, argv)
    args.seq_list = [int(s) for s in args.seq.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(
        f"context-parallel attention benchmark: torch {torch.__version__}, CP={CP}, 2 ranks x 1 "
        f"thread (gloo), {platform.machine()} ({os.cpu_count()} cpus)"
    )
    start = time.perf_counter()
    result = summarize(args, run_distributed(_rank, CP, args, timeout=args.timeout))
    print(
        f"forward + backward of causal attention: batch {args.batch}, {args.heads} heads, "
        f"{args.groups} query groups, head dim {args.head_dim}, fp32; {args.warmup} warm-up "
        f"steps, {args.rounds} rounds x {args.steps} steps, rotating; ms = slower rank, median "
        "of the round's steps; ratios: median over rounds of the per-round ratio\n"
    )
    print(f"{'variant':22} {'median ms':>9} {'best ms':>8} {'CPU ms':>8} {'vs CP1':>7} "
          f"{'vs p2p':>7} {'max diff':>9}")  # fmt: skip
    for name, s in result["summary"].items():
        print(
            f"{name:22} {s['median_ms']:9.1f} {s['best_ms']:8.1f} {s['median_cpu_ms']:8.1f} "
            f"{s['ratio_to_cp1']:7.3f} {s['ratio_to_p2p']:7.3f} {s['max_abs_diff_vs_cp1']:9.1e}"
        )
    print(f"({time.perf_counter() - start:.0f} s)")
    result.update(run_record("context_parallel", args))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    worst = max(s["max_abs_diff_vs_cp1"] for s in result["summary"].values())
    if worst > TOLERANCE:
        raise SystemExit(f"a CP variant differs from single-rank attention by {worst:.1e}")
    return result


if __name__ == "__main__":
    main()
