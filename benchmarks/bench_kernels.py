"""Each fused op against its plain-torch reference: forward + backward time, speed-up, error.

One `Case` per op (the table `CASES` below; add a case beside the others for a new op): it
builds the op's inputs at the run's sizes, and the script runs the op's "reference" and its
fused implementation (`--impl`, default "triton"; and "compile" too with `--compile`) from
`megapipe.kernels.dispatch.IMPLEMENTATIONS`, on the same inputs and the same random output
gradient. Columns: reference ms, fused ms (median of `--repeats` forward + backward passes
after `--warmup`), speed-up = reference / fused, and the max error of the fused outputs and
every input gradient against the reference's, as max |fused - reference| / max |reference|
over each tensor (the largest over the op's tensors).

On CUDA it times real sizes (`--tokens 8192 --hidden 4096`, bf16 by default) with CUDA events.
On CPU it only checks that the harness works: Triton's interpreter (TRITON_INTERPRET=1, set
here) against the reference on tiny fp32 shapes; its times are not meaningful and it says so.

    python benchmarks/bench_kernels.py                 # CPU: harness check, ~20 s
    python benchmarks/bench_kernels.py --compile       # CUDA: also torch.compile'd references
    python benchmarks/bench_kernels.py --impl triton,apex,te   # CUDA: every fused library

Writes benchmarks/out/kernels.json (`--json PATH`; '' for none). Exits 1 if an error exceeds
`--tolerance` (default by dtype: fp32 1e-5, bf16 2e-2, fp16 2e-3).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.kernels.availability import Availability, detect, triton_probe  # noqa: E402
from megapipe.kernels.dispatch import IMPLEMENTATIONS, REQUIRES  # noqa: E402
from megapipe.testing.kernel_cases import (  # noqa: E402
    CASES,
    CPU_SIZES,
    Case,
    Inputs,
    Sizes,
    forward_backward,
    leaves,
    max_error,
)

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "kernels.json")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _step(fn: Callable, inputs: Inputs, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward (the timed unit); the output."""
    for leaf in leaves(inputs):
        leaf.grad = None
    out = fn(*inputs.args)
    out.backward(grad)
    return out


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def measure(case: Case, impls: list[str], args, sizes: Sizes, device: torch.device) -> dict:
    """One table row: the reference's and each implementation's times, speed-up and error."""
    dtype, cuda = DTYPES[args.dtype], device.type == "cuda"
    inputs = case.make(sizes, dtype, device, torch.Generator(device=device).manual_seed(0))
    table = IMPLEMENTATIONS[case.op]
    with torch.no_grad():
        out = table["reference"](*inputs.args)
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)
    want = forward_backward(table["reference"], inputs, grad)
    row = {"op": case.op, "shape": inputs.shape, "dtype": args.dtype}
    forward = lambda fn: lambda: fn(*inputs.args)
    both = lambda fn: lambda: _step(fn, inputs, grad)
    with torch.no_grad():
        row["reference_forward_ms"] = _median_ms(
            forward(table["reference"]), args.repeats, args.warmup, cuda
        )
    row["reference_ms"] = _median_ms(both(table["reference"]), args.repeats, args.warmup, cuda)
    for impl in impls:
        if impl not in table:
            row[f"{impl}_ms"] = None
            continue
        row[f"{impl}_error"] = max_error(forward_backward(table[impl], inputs, grad), want)
        with torch.no_grad():
            row[f"{impl}_forward_ms"] = _median_ms(
                forward(table[impl]), args.repeats, args.warmup, cuda
            )
        row[f"{impl}_ms"] = _median_ms(both(table[impl]), args.repeats, args.warmup, cuda)
        row[f"{impl}_speedup"] = row["reference_ms"] / row[f"{impl}_ms"]
    return row


def print_table(rows: list[dict], impls: list[str]) -> None:
    header = f"{'op':<18} {'shape':<20} {'reference ms':>12}"
    for impl in impls:
        header += f" {impl + ' ms':>12} {'speed-up':>8} {'max error':>10}"
    print(header)
    for row in rows:
        line = f"{row['op']:<18} {row['shape']:<20} {row['reference_ms']:>12.3f}"
        for impl in impls:
            if row.get(f"{impl}_ms") is None:
                line += f" {'-':>12} {'-':>8} {'-':>10}"
            else:
                line += (
                    f" {row[f'{impl}_ms']:>12.3f} {row[f'{impl}_speedup']:>7.2f}x"
                    f" {row[f'{impl}_error']:>10.2e}"
                )
        print(line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--impl",
        default="triton",
        help="the fused implementations to compare, comma-separated (triton, apex, te); "
        "those whose library cannot run here are left out, with a note",
    )
    p.add_argument("--compile", action="store_true", help="also time torch.compile (CUDA only)")
    p.add_argument("--ops", nargs="*", default=None, help="a subset of the cases, by op name")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=None, help="default: 20 on CUDA, 2 on CPU")
    p.add_argument("--warmup", type=int, default=None, help="default: 5 on CUDA, 1 on CPU")
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.repeats = args.repeats or (20 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    tolerance = args.tolerance or TOLERANCE[DTYPES[args.dtype]]
    if cuda:
        ffn = args.ffn or 4 * args.hidden
        sizes = Sizes(args.tokens, args.hidden, ffn, args.heads, args.micro_batch)
        mode = f"CUDA ({torch.cuda.get_device_name()}): real sizes, CUDA-event timing"
    else:
        sizes = CPU_SIZES
        mode = "CPU: harness check only (Triton interpreter on tiny shapes; times not meaningful)"
    impls = args.impl.split(",") + (["compile"] if args.compile and cuda else [])
    found = detect() if cuda else Availability.nothing("CPU: only the Triton interpreter runs")
    for impl in list(impls):
        library = REQUIRES.get(impl)
        probe = triton_probe() if library == "triton" else getattr(found, library or "", None)
        if library is not None and not probe.available:
            impls.remove(impl)
            mode += f"; no {impl} ({probe.reason})"
    print(f"bench_kernels: {mode}; {args.dtype}; median of {args.repeats} fwd+bwd")
    cases = [c for c in CASES if args.ops is None or c.op in args.ops]
    rows = [measure(case, impls, args, sizes, device) for case in cases]
    print_table(rows, impls)
    failed = [
        f"{row['op']} {impl} error {row[f'{impl}_error']:.2e}"
        for row in rows
        for impl in impls
        if row.get(f"{impl}_error") is not None and not row[f"{impl}_error"] <= tolerance
    ]
    result = {
        "mode": mode,
        "device": str(device),
        "dtype": args.dtype,
        "sizes": dataclasses.asdict(sizes),
        "tolerance": tolerance,
        "rows": rows,
        "failed": failed,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if failed:
        print("errors above tolerance " + f"{tolerance:g}: " + "; ".join(failed))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
