"""The timing flags every alternating-rounds benchmark takes, --quick's meaning for them, and the
rounds themselves for the benchmarks whose variants run side by side on forked ranks."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch.distributed as dist


def add_round_args(
    p: argparse.ArgumentParser, *, warmup: int, rounds: int, steps: int, default_json: str
) -> None:
    """--warmup, --rounds, --steps (per side per round), --json and --quick."""
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per side")
    p.add_argument("--rounds", type=int, default=rounds, help="alternating timed rounds")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per side per round")
    p.add_argument("--json", default=default_json, help="'' to skip writing")
    p.add_argument("--quick", action="store_true", help="1 warm-up step, 3 rounds of 2 steps")


def parse_round_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; --quick overrides the round counts (a smoke test: ratios not meaningful)."""
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 3, 2
    return args


def rotating_rounds(
    steps: dict[str, Callable[[], tuple[float, float]]], args: argparse.Namespace
) -> tuple[dict[str, list], dict[str, list]]:
    """Time each variant's step on this rank: --warmup untimed steps each, then --rounds
    rounds of --steps steps each, the variants' order rotating round by round, a barrier before
    every step (collective: every rank calls it alike). Returns (history: each variant's
    (loss, grad norm) of every step, warm-up included; times: [round][step] of (wall ms,
    process CPU ms))."""
    names = list(steps)
    history: dict[str, list] = {n: [] for n in names}
    times: dict[str, list] = {n: [] for n in names}

    def timed(name: str) -> tuple[float, float]:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        history[name].append(steps[name]())
        return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3

    for name in names:
        for _ in range(args.warmup):
            timed(name)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append([timed(name) for _ in range(args.steps)])
    return history, times


def run_record(benchmark: str, args: argparse.Namespace) -> dict:
    """What a benchmark's JSON says about its run: name, UTC time, torch, machine, settings."""
    import datetime
    import os
    import platform

    import torch

    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
