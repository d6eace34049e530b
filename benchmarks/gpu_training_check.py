"""Train a small GPT with pretrain_gpt.py in fp32, bf16 and fp16 and check the losses.

Each precision is one `python pretrain_gpt.py --mock-data ...` run of the same model, seed and
batches (mock data are counting sequences, which a small model learns within a few steps).
The checks, per precision: every iteration logged a finite loss, the loss fell (last below
first by `--min-drop` nats), no iteration was skipped for an fp16 overflow, and each
iteration's loss is within the precision's relative tolerance of fp32's at that iteration
(bf16 5e-2, fp16 2e-2: their rounding compounds over the steps; fp32 against fp32 1e-5).
Where TransformerEngine is installed, bf16 with --transformer-impl transformer_engine runs too
(5e-2), and on a GPU of compute capability 8.9+ also with --fp8-format hybrid (1e-1).

    python benchmarks/gpu_training_check.py            # CUDA: fp32, bf16, fp16 (~1 minute)
    python benchmarks/gpu_training_check.py --tiny     # CPU: the harness at a tiny size, fp32
                                                       # against a second fp32 run (CI)

Prints one table last; writes benchmarks/out/gpu_training_check.json (`--json PATH`, '' for
none); exits 1 if a check failed, 2 (one line on stderr) if a run could not start or finish.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = str(ROOT / "benchmarks" / "out" / "gpu_training_check.json")


def fail(message: str) -> None:
    """A run could not be measured: one line on stderr, named after the script, exit 2."""
    print(f"{Path(sys.argv[0]).stem}: {message}", file=sys.stderr)
    raise SystemExit(2)


TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 2e-2, "te-bf16": 5e-2, "te-fp8": 1e-1}
TE = ["--transformer-impl", "transformer_engine"]
PRECISION_FLAGS = {
    "fp32": [],
    "bf16": ["--bf16"],
    "fp16": ["--fp16", "--initial-loss-scale", "4096"],
    "te-bf16": ["--bf16", *TE],  # TransformerEngine's layers (when installed)
    "te-fp8": ["--bf16", *TE, "--fp8-format", "hybrid"],  # and FP8 (compute capability 8.9+)
}
LOSS_LINE = re.compile(
    r"^ iteration +(\d+)/ *\d+ \|.*\| lm loss: (\S+) \|.*"
    r"\| number of skipped iterations: +(\d+) \|"
)


@dataclass(frozen=True)
class Size:
    """The model and run: pretrain_gpt.py's flags."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    global_batch: int
    iters: int
    lr: float

    def flags(self) -> list[str]:
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
            "--max-position-embeddings", str(self.seq), "--vocab-size", str(self.vocab),
            "--micro-batch-size", str(self.micro_batch),
            "--global-batch-size", str(self.global_batch), "--train-iters", str(self.iters),
            "--lr", str(self.lr), "--min-lr", str(self.lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--mock-data", "--eval-iters", "0", "--log-interval", "1",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
        ]  # fmt: skip


GPU_SIZE = Size(layers=4, hidden=512, heads=8, seq=512, vocab=4096, micro_batch=8,
                global_batch=16, iters=30, lr=1e-3)  # fmt: skip
TINY_SIZE = Size(layers=2, hidden=32, heads=4, seq=16, vocab=128, micro_batch=2,
                 global_batch=4, iters=6, lr=3e-3)  # fmt: skip


@dataclass
class Run:
    """One precision's run and its verdict."""

    label: str
    precision: str
    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    max_relative_difference: float | None = None  # against the fp32 baseline
    tolerance: float | None = None
    failures: list[str] = field(default_factory=list)


def parse_losses(stdout: str) -> tuple[list[float], int]:
    """The lm loss of every logged iteration (in order) and the last skipped-iterations count."""
    losses, skipped = [], 0
    for line in stdout.splitlines():
        match = LOSS_LINE.match(line)
        if match:
            losses.append(float(match.group(2)))
            skipped = int(match.group(3))
    return losses, skipped


def add_harness_args(parser: argparse.ArgumentParser, tiny: str, timeout: float, json: str):
    """The flags both GPU harnesses take: --tiny (the CPU check), --timeout, --json."""
    parser.add_argument("--tiny", action="store_true", help=tiny)
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
    parser.add_argument("--json", default=json, help="'' to skip writing")


def require_cuda(tiny: bool) -> None:
    """`fail` on a machine without CUDA unless this is the --tiny CPU check."""
    import torch

    if not tiny and not torch.cuda.is_available():
        fail("no CUDA device; use --tiny for the CPU harness check")


def pretrain_stdout(flags: list[str], timeout: float, what: str) -> str:
    """The stdout of one `python pretrain_gpt.py FLAGS` run (launcher variables cleared);
    `fail` with the run's last stderr lines if it exits non-zero or runs out of time."""
    command = [sys.executable, str(ROOT / "pretrain_gpt.py"), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        fail(f"the {what} run took over {timeout:.0f} s")
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        fail(f"the {what} run exited {done.returncode}: {tail}")
    return done.stdout


def train(size: Size, precision: str, timeout: float) -> tuple[list[float], int]:
    """Run pretrain_gpt.py once in `precision`; (losses, skipped iterations)."""
    flags = size.flags() + PRECISION_FLAGS[precision]
    return parse_losses(pretrain_stdout(flags, timeout, precision))


def judge(run: Run, baseline: Run | None, size: Size, min_drop: float) -> None:
    """Fill in the run's verdict against the fp32 baseline (None: the baseline itself)."""
    losses = run.losses
    if len(losses) != size.iters:
        run.failures.append(f"{len(losses)} of {size.iters} iterations logged a loss")
    if not all(math.isfinite(x) for x in losses):
        run.failures.append("a loss is not finite")
    elif losses and not losses[-1] < losses[0] - min_drop:
        run.failures.append(f"loss fell {losses[0] - losses[-1]:.3f} < {min_drop} nats")
    if run.skipped:
        run.failures.append(f"{run.skipped} iterations skipped (fp16 overflow)")
    if baseline is None:
        return
    run.tolerance = TOLERANCE[run.precision]
    pairs = list(zip(run.losses, baseline.losses))
    if pairs:
        diffs = [abs(a - b) / abs(b) if math.isfinite(a) else math.inf for a, b in pairs]
        run.max_relative_difference = max(diffs)
        if not run.max_relative_difference <= run.tolerance:
            worst = diffs.index(run.max_relative_difference) + 1
            run.failures.append(
                f"iteration {worst}: {run.max_relative_difference:.2e} from fp32 "
                f"> {run.tolerance:g}"
            )


def print_table(runs: list[Run]) -> None:
    print(f"{'run':<12} {'first loss':>10} {'last loss':>10} {'vs fp32':>9} {'tolerance':>9}"
          f" {'skipped':>7}  verdict")  # fmt: skip
    for run in runs:
        first = f"{run.losses[0]:.4f}" if run.losses else "-"
        last = f"{run.losses[-1]:.4f}" if run.losses else "-"
        diff = "-" if run.max_relative_difference is None else f"{run.max_relative_difference:.2e}"
        tol = "-" if run.tolerance is None else f"{run.tolerance:g}"
        verdict = "ok" if not run.failures else "FAIL: " + "; ".join(run.failures)
        print(f"{run.label:<12} {first:>10} {last:>10} {diff:>9} {tol:>9} {run.skipped:>7}"
              f"  {verdict}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_harness_args(parser, "CPU harness check: fp32 vs fp32", 150.0, DEFAULT_JSON)
    parser.add_argument("--iters", type=int, default=None, help="override the run length")
    parser.add_argument("--min-drop", type=float, default=None,
                        help="nats the loss must fall (default 1.0; --tiny 0.05)")  # fmt: skip
    args = parser.parse_args(argv)
    require_cuda(args.tiny)
    import torch

    size = TINY_SIZE if args.tiny else GPU_SIZE
    if args.iters:
        size = Size(**dict(asdict(size), iters=args.iters))
    min_drop = args.min_drop if args.min_drop is not None else (0.05 if args.tiny else 1.0)
    plan = [("fp32", "fp32"), ("fp32-repeat", "fp32")] if args.tiny else [
        ("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")]  # fmt: skip
    if not args.tiny and importlib.util.find_spec("transformer_engine") is not None:
        plan.append(("te-bf16", "te-bf16"))
        if torch.cuda.get_device_capability() >= (8, 9):
            plan.append(("te-fp8", "te-fp8"))
    # One GPU: one run at a time. The CPU check runs its two side by side (CI's wall time).
    with ThreadPoolExecutor(len(plan) if args.tiny else 1) as pool:
        results = list(pool.map(lambda p: train(size, p[1], args.timeout), plan))
    runs = []
    for (label, precision), (losses, skipped) in zip(plan, results, strict=True):
        run = Run(label, precision, losses, skipped)
        judge(run, runs[0] if runs else None, size, min_drop)
        runs.append(run)
    device = "cpu" if args.tiny else torch.cuda.get_device_name()
    if args.json:
        from megapipe.atomic_files import write_json

        write_json(args.json, {"device": device, "size": asdict(size), "min_drop": min_drop,
                               "runs": [asdict(r) for r in runs]})  # fmt: skip
    print(f"gpu_training_check on {device}: {size.layers} layers, hidden {size.hidden}, "
          f"seq {size.seq}, {size.iters} iterations")  # fmt: skip
    print_table(runs)
    return 1 if any(r.failures for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
