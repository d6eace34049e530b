"""Single-GPU training throughput and MFU: megapipe against a plain-PyTorch GPT of the same math.

megapipe runs as users run it: `python pretrain_gpt.py --bf16 --attention-backend flash ...` on
mock data, with the fused kernels dispatch picks on the GPU (the log's `kernels:` line says
which); its time per iteration is the log line's `elapsed time per iteration`. The plain model
(`megapipe/testing/reference_gpt.py`: torch.nn modules, scaled_dot_product_attention, no fusions) is
trained here the way plain PyTorch does mixed precision: fp32 weights under
`torch.autocast(bfloat16)`, fused AdamW, the same micro-batches and gradient accumulation, an
iteration timed wall-clock to a CUDA synchronise. Both skip `--warmup` iterations and report
the median of the rest.

MFU = model FLOPs per iteration (megapipe/training/flops.py, Megatron's count) / time / the
GPU's dense bf16 peak (flops.device_peak_tflops: 989.4 TFLOP/s for H100 SXM / H200; or
`--peak-tflops`).

    python benchmarks/bench_gpu_mfu.py          # CUDA: ~1.3B GPT (24 x 2048, 16 heads, seq 2048)
    python benchmarks/bench_gpu_mfu.py --tiny   # CPU: the harness at a tiny size, fp32 (CI)

Prints one table last; writes benchmarks/out/gpu_mfu.json (`--json PATH`, '' for none). A run
that fails: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_training_check import (
    add_harness_args,
    fail,
    pretrain_stdout,
    require_cuda,
)  # benchmarks/: the script's own folder

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = str(ROOT / "benchmarks" / "out" / "gpu_mfu.json")

ELAPSED = re.compile(r"^ iteration +(\d+)/.*\| elapsed time per iteration \(ms\): ([\d.]+) \|")


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int  # a multiple of 128: no padding, so both models multiply the same logits
    micro_batch: int
    global_batch: int


GPU_SIZE = Size(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304, micro_batch=4,
                global_batch=16)  # fmt: skip
TINY_SIZE = Size(layers=2, hidden=64, heads=4, seq=64, vocab=256, micro_batch=2, global_batch=4)


def model_config(size: Size):
    from megapipe.config import ModelConfig

    return ModelConfig(num_layers=size.layers, hidden_size=size.hidden,
                       num_attention_heads=size.heads, vocab_size=size.vocab,
                       seq_length=size.seq, attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip


def megapipe_times(size: Size, iters: int, cuda: bool, timeout: float) -> tuple[list[float], str]:
    """Seconds of each logged iteration of a pretrain_gpt.py run, and its `kernels:` line."""
    flags = [
        "--num-layers", str(size.layers), "--hidden-size", str(size.hidden),
        "--num-attention-heads", str(size.heads), "--seq-length", str(size.seq),
        "--max-position-embeddings", str(size.seq), "--vocab-size", str(size.vocab),
        "--micro-batch-size", str(size.micro_batch), "--global-batch-size", str(size.global_batch),
        "--train-iters", str(iters), "--lr", "1e-4", "--mock-data", "--eval-iters", "0",
        "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
    ]  # fmt: skip
    if cuda:
        flags += ["--bf16", "--attention-backend", "flash"]
    lines = pretrain_stdout(flags, timeout, "megapipe").splitlines()
    times = [float(m.group(2)) / 1e3 for m in map(ELAPSED.match, lines) if m]
    kernels = next((line for line in lines if line.startswith("kernels: ")), "")
    if len(times) != iters:
        fail(f"megapipe logged {len(times)} of {iters} iterations")
    return times, kernels


def plain_times(size: Size, iters: int, device) -> list[float]:
    """Seconds of each iteration of the plain model: forward + backward of every micro-batch,
    AdamW step, zero_grad; bf16 autocast on CUDA, fp32 on CPU."""
    import torch

    from megapipe.testing.reference_gpt import PlainGPT

    torch.manual_seed(0)
    with device:  # initialised where it runs (1.3B normal draws on a CPU take a while)
        model = PlainGPT(size.layers, size.hidden, size.heads, size.vocab, size.seq, 0.0)
    model.train()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    micro_batches = size.global_batch // size.micro_batch
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(size.vocab, (micro_batches, size.micro_batch, size.seq + 1),
                           generator=generator, device=device)  # fmt: skip
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        for m in range(micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(tokens[m, :, :-1], tokens[m, :, 1:]).mean() / micro_batches
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return times


def row(name: str, times: list[float], warmup: int, flops: int, tokens: int, peak: float | None):
    seconds = statistics.median(times[warmup:])
    tflops = flops / seconds / 1e12
    return {"model": name, "seconds_per_iteration": seconds, "tokens_per_second": tokens / seconds,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "iteration_seconds": times}  # fmt: skip


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'model':<26} {'s/iter':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} {'vs plain':>8}")
    plain = next(r for r in rows if r["model"].startswith("plain"))
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = plain["seconds_per_iteration"] / r["seconds_per_iteration"]
        print(f"{r['model']:<26} {r['seconds_per_iteration']:>8.3f} {r['tokens_per_second']:>10.0f}"
              f" {r['tflops']:>8.3g} {mfu:>7} {ratio:>7.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_harness_args(parser, "CPU harness check at a tiny size", 200.0, DEFAULT_JSON)
    parser.add_argument("--iters", type=int, default=None, help="timed + warm-up (GPU 10)")
    parser.add_argument("--warmup", type=int, default=None, help="iterations not timed (GPU 4)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak (default: from its name, bf16)")  # fmt: skip
    args = parser.parse_args(argv)
    require_cuda(args.tiny)
    import torch

    from megapipe.training.flops import device_peak_tflops, flops_per_iteration

    cuda = not args.tiny
    size = TINY_SIZE if args.tiny else GPU_SIZE
    iters = args.iters or (3 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 4)
    if not 0 <= warmup < iters:
        fail(f"--warmup {warmup} must be below --iters {iters}")
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_tflops or (device_peak_tflops(name, torch.bfloat16) if cuda else None)
    flops = flops_per_iteration(model_config(size), size.global_batch, padded_vocab_size=size.vocab)
    tokens = size.global_batch * size.seq
    mp_times, kernels = megapipe_times(size, iters, cuda, args.timeout)
    precision = "bf16, flash" if cuda else "fp32"
    rows = [row(f"megapipe ({precision})", mp_times, warmup, flops, tokens, peak)]
    rows.append(row(f"plain PyTorch ({'bf16 autocast' if cuda else 'fp32'})",
                    plain_times(size, iters, device), warmup, flops, tokens, peak))  # fmt: skip
    params = 12 * size.layers * size.hidden**2 + size.vocab * size.hidden
    title = (f"bench_gpu_mfu on {name}: {size.layers} layers x {size.hidden}, {size.heads} heads, "
             f"seq {size.seq}, ~{params / 1e9:.2f}B parameters, global batch {size.global_batch} "
             f"(micro {size.micro_batch}); median of {iters - warmup} iterations after {warmup}; "
             f"peak {peak if peak else '-'} TFLOP/s")  # fmt: skip
    result = {"device": name, "size": asdict(size), "flops_per_iteration": flops,
              "peak_tflops": peak, "kernels": kernels, "rows": rows}  # fmt: skip
    if args.json:
        from megapipe.atomic_files import write_json

        write_json(args.json, result)
    print(kernels or "kernels: (not printed)")
    print_table(rows, title)
    return result


if __name__ == "__main__":
    main()
