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
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.kernels.availability import triton_probe  # noqa: E402
from megapipe.kernels.dispatch import IMPLEMENTATIONS  # noqa: E402
from megapipe.model.rotary import RotaryEmbedding  # noqa: E402
from megapipe.parallel.state import Group  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "kernels.json")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Sizes:
    """The model sizes the inputs are cut from: tokens = seq x micro_batch."""

    tokens: int
    hidden: int
    ffn: int
    heads: int
    micro_batch: int

    @property
    def seq(self) -> int:
        return self.tokens // self.micro_batch


# Sizes on each kind of device. CPU: tiny and deliberately not powers of two (partial tiles).
CPU_SIZES = Sizes(tokens=24, hidden=40, ffn=72, heads=2, micro_batch=2)


@dataclass(frozen=True)
class Inputs:
    """The op's positional arguments (tensors that want gradients have requires_grad) and
    the shape shown in the table."""

    args: tuple
    shape: str


@dataclass(frozen=True)
class Case:
    """One op: its name in dispatch's table and how to build its inputs."""

    op: str
    make: Callable[[Sizes, torch.dtype, torch.device, torch.Generator], Inputs]


def _randn(shape, dtype, device, gen, *, grad=True, scale=1.0) -> torch.Tensor:
    t = (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)
    return t.requires_grad_(grad)


def _bias_gelu(sizes, dtype, device, gen) -> Inputs:
    x = _randn((sizes.tokens, sizes.ffn), dtype, device, gen, scale=2.0)
    return Inputs(
        (x, _randn((sizes.ffn,), dtype, device, gen), "none"), f"{sizes.tokens}x{sizes.ffn}"
    )


def _bias_dropout_add(sizes, dtype, device, gen) -> Inputs:
    shape = (sizes.seq, sizes.micro_batch, sizes.hidden)
    keep = torch.rand(shape, generator=gen, device=device) >= 0.1
    x, residual = _randn(shape, dtype, device, gen), _randn(shape, dtype, device, gen)
    bias = _randn((sizes.hidden,), dtype, device, gen)
    return Inputs((x, bias, residual, keep, 1.0 / 0.9), "x".join(map(str, shape)))


def _swiglu(sizes, dtype, device, gen) -> Inputs:
    h = _randn((sizes.tokens, 2 * sizes.ffn), dtype, device, gen, scale=2.0)
    return Inputs((h, None), f"{sizes.tokens}x{2 * sizes.ffn}")


def _rotary(sizes, dtype, device, gen) -> Inputs:
    head_dim = sizes.hidden // sizes.heads
    table = RotaryEmbedding(head_dim, max_positions=sizes.seq).to(device)
    x = _randn((sizes.seq, sizes.micro_batch, sizes.heads, head_dim), dtype, device, gen)
    return Inputs((x, table.cos, table.sin, 0), "x".join(map(str, x.shape)))


def _norm_inputs(sizes, dtype, device, gen, *, bias: bool) -> Inputs:
    x = _randn((sizes.seq, sizes.micro_batch, sizes.hidden), dtype, device, gen, scale=2.0)
    weight = (1 + 0.1 * torch.randn(sizes.hidden, generator=gen, device=device)).to(dtype)
    params = (weight.requires_grad_(),)
    if bias:
        params += (_randn((sizes.hidden,), dtype, device, gen, scale=0.1),)
    return Inputs((x, *params, 1e-5), "x".join(map(str, x.shape)))


def _layer_norm(sizes, dtype, device, gen) -> Inputs:
    return _norm_inputs(sizes, dtype, device, gen, bias=True)


def _rms_norm(sizes, dtype, device, gen) -> Inputs:
    return _norm_inputs(sizes, dtype, device, gen, bias=False)


def _attention_scores(sizes, dtype, device, gen) -> torch.Tensor:
    shape = (sizes.micro_batch, sizes.heads, sizes.seq, sizes.seq)
    return _randn(shape, dtype, device, gen, scale=3.0)


def _causal_softmax(sizes, dtype, device, gen) -> Inputs:
    scores = _attention_scores(sizes, dtype, device, gen)
    return Inputs((scores, None, 0.125), "x".join(map(str, scores.shape)) + " causal")


def _masked_softmax(sizes, dtype, device, gen) -> Inputs:
    """Causal within documents of a quarter of the sequence (--reset-attention-mask)."""
    scores = _attention_scores(sizes, dtype, device, gen)
    document = torch.arange(sizes.seq, device=device) * 4 // sizes.seq
    causal = torch.ones(sizes.seq, sizes.seq, dtype=torch.bool, device=device).tril()
    mask = (causal & (document[:, None] == document[None, :])).expand(sizes.micro_batch, 1, -1, -1)
    return Inputs((scores, mask, 0.125), "x".join(map(str, scores.shape)) + " mask")


VOCAB = {"cuda": (50257, 50304), "cpu": (77, 80)}  # (real vocabulary, padded logits)


def _cross_entropy(sizes, dtype, device, gen) -> Inputs:
    vocab, padded = VOCAB[device.type]
    logits = _randn((sizes.seq, sizes.micro_batch, padded), dtype, device, gen, scale=2.0)
    target = torch.randint(0, vocab, (sizes.seq, sizes.micro_batch), generator=gen, device=device)
    return Inputs((logits, target, Group.single(), 0, vocab), "x".join(map(str, logits.shape)))


# The ops to measure, in table order (the other kernel ops add their cases here).
CASES = [
    Case("bias_gelu", _bias_gelu),
    Case("bias_dropout_add", _bias_dropout_add),
    Case("swiglu", _swiglu),
    Case("rotary", _rotary),
    Case("layer_norm", _layer_norm),
    Case("rms_norm", _rms_norm),
    Case("masked_softmax", _causal_softmax),
    Case("masked_softmax", _masked_softmax),
    Case("cross_entropy", _cross_entropy),
]


def _leaves(inputs: Inputs) -> list[torch.Tensor]:
    return [a for a in inputs.args if isinstance(a, torch.Tensor) and a.requires_grad]


def _step(fn: Callable, inputs: Inputs, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward (the timed unit); the output."""
    for leaf in _leaves(inputs):
        leaf.grad = None
    out = fn(*inputs.args)
    out.backward(grad)
    return out


def _results(fn: Callable, inputs: Inputs, grad: torch.Tensor) -> list[torch.Tensor]:
    """The output and every input gradient of one forward + backward."""
    out = _step(fn, inputs, grad)
    return [out.detach()] + [leaf.grad.clone() for leaf in _leaves(inputs)]


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


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest over tensors of max |got - want| / max |want|."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        scale = b.double().abs().max().item() or 1.0
        error = (a.double() - b.double()).abs().max().item()
        worst = max(worst, error / scale if torch.isfinite(a).all() else float("inf"))
    return worst


def measure(case: Case, impls: list[str], args, sizes: Sizes, device: torch.device) -> dict:
    """One table row: the reference's and each implementation's times, speed-up and error."""
    dtype, cuda = DTYPES[args.dtype], device.type == "cuda"
    inputs = case.make(sizes, dtype, device, torch.Generator(device=device).manual_seed(0))
    table = IMPLEMENTATIONS[case.op]
    with torch.no_grad():
        out = table["reference"](*inputs.args)
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)
    want = _results(table["reference"], inputs, grad)
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
        row[f"{impl}_error"] = max_error(_results(table[impl], inputs, grad), want)
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
    p.add_argument("--impl", default="triton", help="the fused implementation to compare")
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
    impls = [args.impl] + (["compile"] if args.compile and cuda else [])
    probe = triton_probe()
    if not probe.available:
        impls = [i for i in impls if i not in ("triton", "compile")]
        mode += f"; no Triton ({probe.reason}): reference only"
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
