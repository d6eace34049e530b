"""The whole training step at one rank: megapipe's `train_step` against a plain-PyTorch loop.

megapipe's side is what `pretrain_gpt.py` runs every iteration: the mock-data reader, the
executor over the micro-batches, the GradBuffer (main_grad accumulation and bucket
bookkeeping), finalize_model_grads, the global loss, the ShardedOptimizer's norm, clipping,
NaN check and AdamW step, zero_grad. The plain side is the loop a PyTorch user writes for the
same math: `megapipe/testing/reference_gpt.py`'s PlainGPT with megapipe's initial weights,
`torch.optim.AdamW` (weight decay on the matrices only, as Megatron), `clip_grad_norm_`, the
same batches from the same MockGPTDataset, `loss.item()` per micro-batch.

Both are timed in alternating rounds (AB, BA, ...) after a warm-up, as bench_overhead.py does;
the headline is the median per-round ratio megapipe / plain (target <= 1.03).

    python benchmarks/bench_step.py                  # ~1 minute on 2 cores
    python benchmarks/bench_step.py --quick          # smoke test (ratio not meaningful)
    python benchmarks/bench_step.py --profile        # torch.profiler tables of both steps
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import add_round_args, parse_round_args  # noqa: E402

from megapipe.atomic_files import write_json  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "step.json")


def model_flags(args: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py's flags for the benchmark's model and batch (mock data, no dropout)."""
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab),
        "--micro-batch-size", str(args.micro_batch),
        "--global-batch-size", str(args.micro_batch * args.micro_batches),
        "--mock-data", "--train-iters", "1000000", "--lr", str(args.lr),
        "--weight-decay", "0.1", "--clip-grad", str(args.clip_grad),
        "--position-embedding-type", "rope",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", str(args.seed),
    ]  # fmt: skip


class MegapipeStep:
    """megapipe's training step on this rank, built the way pretrain_gpt.py builds it.

    `flags`: pretrain_gpt.py's flags; `world_size` and `state`: the layout (one rank when
    `state` is None).
    """

    def __init__(self, flags: list[str], world_size: int = 1, state=None) -> None:
        from megapipe.arguments import parse_args
        from megapipe.parallel.state import ParallelState
        from megapipe.training.step_by_step import Stepper

        configs = parse_args(flags, world_size)
        parallel = configs.parallel
        if state is None:
            state = ParallelState.single()
            if world_size > 1:
                state = ParallelState.build(
                    parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
                )
        self.stepper = Stepper.build(configs, state)
        self.configs, self.state = configs, state
        self.chunks, self.data = self.stepper.chunks, self.stepper.data
        self.micro_batch = configs.training.micro_batch_size

    def __call__(self) -> float:
        return self.stepper.step().lm_loss


class PlainStep:
    """The same step written with plain PyTorch: PlainGPT, AdamW, clip_grad_norm_."""

    def __init__(self, args: argparse.Namespace, megapipe: MegapipeStep) -> None:
        from megapipe.testing.reference_gpt import reference_from_megapipe

        self.model = reference_from_megapipe(megapipe.chunks[0]).train()
        params = list(self.model.parameters())
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
            ],
            lr=args.lr,
            **kind[args.plain_adamw],
        )
        self.params, self.clip = params, args.clip_grad
        self.data = megapipe.data  # the same MockGPTDataset: the same batches
        self.micro_batch, self.micro_batches = args.micro_batch, args.micro_batches
        self.iteration = 0

    def __call__(self) -> float:
        first = self.iteration * self.micro_batch * self.micro_batches
        self.iteration += 1
        total = 0.0
        for m in range(self.micro_batches):
            start = first + m * self.micro_batch
            batch = self.data.batch(range(start, start + self.micro_batch))
            loss = (self.model(batch.tokens, batch.labels) * batch.loss_mask).sum()
            loss = loss / batch.loss_mask.sum()
            (loss / self.micro_batches).backward()
            total += loss.item()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total / self.micro_batches


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(step: Callable[[], float], n: int, clock: str) -> list[float]:
    """Seconds of each of n steps on `clock`: wall time, or this process's CPU time (with one
    thread, the wall time minus the time other processes held the cores: on a machine shared
    with other jobs it is the steadier measure of the work a step does)."""
    now = CLOCKS[clock]
    times = []
    for _ in range(n):
        start = now()
        step()
        times.append(now() - start)
    return times


def alternate(steps: dict[str, Callable[[], float]], rounds: int, n: int, clock: str) -> list[dict]:
    """`rounds` rounds of `n` steps of each, the order alternating; each round's time is the
    median of its steps (one step hit by a noisy neighbour does not move it)."""
    names = list(steps)
    out = []
    for r in range(rounds):
        ms: dict[str, list[float]] = {}
        for name in names if r % 2 == 0 else names[::-1]:
            ms[name] = [t * 1e3 for t in time_steps(steps[name], n, clock)]
        out.append({"round": r, **{f"{k}_ms": statistics.median(v) for k, v in ms.items()}})
    return out


def profile(step: Callable[[], float], n: int, label: str, rows: int) -> None:
    from torch.profiler import profile as torch_profile

    with torch_profile() as prof:
        for _ in range(n):
            step()
    print(f"\n== torch.profiler: {label}, {n} steps ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024, help="a multiple of 128 (no padding)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=1, help="per step (accumulated)")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--plain-adamw",
        choices=("fused", "foreach", "default"),
        default="fused",
        help="the plain loop's torch.optim.AdamW implementation (default: fused, torch's "
        "fastest on the CPU; 'default' is torch's choice, the for-loop on CPU tensors)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="what a step's time is: this process's CPU time (default; with one thread the "
        "steadier measure on a shared machine) or wall time",
    )
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables")
    add_round_args(p, warmup=5, rounds=30, steps=3, default_json=DEFAULT_JSON)
    return parse_round_args(p, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    megapipe = MegapipeStep(model_flags(args))
    plain = PlainStep(args, megapipe)
    steps = {"megapipe": megapipe, "plain": plain}
    # The same weights, batches and math: the first losses agree to fp32 rounding.
    first = {name: step() for name, step in steps.items()}
    if abs(first["megapipe"] - first["plain"]) > 1e-4 * abs(first["plain"]):
        raise SystemExit(f"first losses differ: {first}: the two steps' math differs")
    for step in steps.values():
        for _ in range(args.warmup - 1):
            step()
    rounds = alternate(steps, args.rounds, args.steps, args.clock)
    for r in rounds:
        r["ratio"] = r["megapipe_ms"] / r["plain_ms"]
    ratios = [r["ratio"] for r in rounds]
    med = {n: statistics.median(r[f"{n}_ms"] for r in rounds) for n in steps}
    med_ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med_ratio,) * 3

    print(
        f"whole-step benchmark: torch {torch.__version__}, {args.threads} thread(s), "
        f"{platform.machine()} ({os.cpu_count()} cpus), load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab}, rope, micro-batch {args.micro_batch} x {args.micro_batches}, "
        f"clip-grad {args.clip_grad}; plain AdamW: {args.plain_adamw}"
    )
    print(f"first losses: megapipe {first['megapipe']:.6f}, plain {first['plain']:.6f}")
    print(f"{args.rounds} alternating rounds x {args.steps} steps each, {args.clock} time\n")
    print(f"{'round':>5}  {'megapipe ms':>11}  {'plain ms':>9}  {'ratio':>6}")
    for r in rounds:
        mp, pl = r["megapipe_ms"], r["plain_ms"]
        print(f"{r['round']:>5}  {mp:>11.2f}  {pl:>9.2f}  {r['ratio']:>6.3f}")
    print(f"{'median':>5}  {med['megapipe']:>11.2f}  {med['plain']:>9.2f}  {med_ratio:>6.3f}")
    met = med_ratio <= 1.03
    print(
        f"\nmedian per-round ratio megapipe/plain: {med_ratio:.3f} (interquartile range "
        f"{q1:.3f}-{q3:.3f}); target <= 1.03: {'met' if met else 'NOT met'}"
    )
    if args.profile:
        profile(megapipe, 10, "megapipe train_step", 30)
        profile(plain, 10, "plain PyTorch step", 30)
    result = {
        "benchmark": "step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "first_loss": first,
        "rounds": rounds,
        "median_ms": med,
        "median_ratio": med_ratio,
        "ratio_quartiles": [q1, q3],
        "target": 1.03,
        "target_met": met,
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    if not math.isfinite(main()["median_ratio"]):
        sys.exit(1)
