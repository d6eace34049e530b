"""The timing flags every alternating-rounds benchmark takes, and --quick's meaning for them."""

from __future__ import annotations

import argparse


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
