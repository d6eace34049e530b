"""Sharded data parallelism (ZeRO-2/3 on torch's FSDP2) at DP=2: step time, side by side.

Two gloo ranks (forked, one thread each) hold, side by side, one model per variant, all
initialised to the same weights (megapipe's layout-invariant initialisation):
* `plain-fsdp2`: the plain-PyTorch loop of the same math, what a PyTorch user writes:
  `megapipe/testing/reference_gpt.py`'s PlainGPT with megapipe's initial weights,
  `fully_shard` on each block and then on the root over the same two ranks, torch AdamW on the
  DTensors (`--plain-adamw`, default fused; no weight decay for 1-D parameters, as megapipe),
  `clip_grad_norm_`, the same micro-batches with gradient accumulation (FSDP2 reduce-scatters
  each micro-batch, as megapipe's ZeRO-2/3 do), the loss all-reduced for the log;
* `zero3` (`--use-torch-fsdp2`), `zero3-prefetch` (with `--overlap-param-gather`: each layer
  prefetches the next one's all-gather), `zero2` (`--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads`), `zero1` (`--use-distributed-optimizer`,
  megapipe's own bucketed buffers): megapipe's own `train_step`, built from Megatron flags
  as `pretrain_gpt.py` builds it (`Stepper`).

One timed step starts after a barrier and ends when the optimizer step is done; its time is
the slower rank's. After a warm-up the variants are timed in rotating order over rounds; a
round's time is the median of its steps; each comparison is the median over rounds of the
per-round ratio (headline: zero3 / plain-fsdp2, target <= 1.05; the others are what sharding
costs: zero3 / zero1 the extra all-gathers, zero2 / zero1, prefetch on / off).
Step 0 must give the same loss (and grad norm) in every variant: same weights, same batch.

    python benchmarks/bench_fsdp.py            # ~1 minute on 2 cores
    python benchmarks/bench_fsdp.py --quick    # smoke test (ratios not meaningful)
    python benchmarks/bench_fsdp.py --profile zero3   # cProfile of rank 0's steps, then exit
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import sys
import time
import warnings

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily; the ranks inherit it)
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import add_round_args, parse_round_args, rotating_rounds  # noqa: E402

from megapipe.arguments import parse_args as parse_megatron_args  # noqa: E402
from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.data.sampler import micro_batch_range  # noqa: E402
from megapipe.data.sources import build_batch_source  # noqa: E402
from megapipe.layers.cross_entropy import masked_mean  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from megapipe.testing.reference_gpt import reference_from_megapipe  # noqa: E402
from megapipe.training.build import build_model_chunks_for  # noqa: E402
from megapipe.training.step_by_step import Stepper  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "fsdp.json")
PLAIN = "plain-fsdp2"
VARIANT_FLAGS = {
    "zero3": ["--use-torch-fsdp2"],
    "zero3-prefetch": ["--use-torch-fsdp2", "--overlap-param-gather"],
    "zero2": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    "zero1": ["--use-distributed-optimizer"],
}
# (label, numerator, denominator, target): ratio = numerator's step time / denominator's
COMPARISONS = (
    ("megapipe ZeRO-3 / plain PyTorch FSDP2", "zero3", PLAIN, 1.05),
    ("megapipe ZeRO-3 / megapipe ZeRO-1", "zero3", "zero1", None),
    ("megapipe ZeRO-2 / megapipe ZeRO-1", "zero2", "zero1", None),
    ("megapipe ZeRO-3, --overlap-param-gather on / off", "zero3-prefetch", "zero3", None),
)
LOSS_TOLERANCE = 1e-5  # step 0, relative to the plain loop's loss and grad norm


def megapipe_argv(args: argparse.Namespace, extra: list[str], world_size: int) -> list[str]:
    """The Megatron flags of one variant (mock data, no dropout)."""
    global_batch = args.micro_batch * args.microbatches * world_size
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--vocab-size", str(args.vocab), "--mock-data",
        "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", "1000000", "--lr", str(args.lr), "--seed", str(args.seed),
        "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000000",
        "--clip-grad", str(args.clip_grad), "--weight-decay", str(args.weight_decay),
        *extra,
    ]  # fmt: skip


class MegapipeRun:
    """One megapipe variant on this rank, built as `train()` builds it, stepped by hand."""

    def __init__(self, argv: list[str], world_size: int) -> None:
        configs = parse_megatron_args(argv, world_size)
        with contextlib.redirect_stdout(io.StringIO()):
            self.stepper = Stepper.build(configs, ParallelState.build(1, 1))

    def step(self) -> tuple[float, float]:
        result = self.stepper.step()
        return result.lm_loss, result.grad_norm


class PlainFSDP2Run:
    """PlainGPT under a plain FSDP2 loop: fully_shard per block and the root, torch AdamW,
    clip_grad_norm_, gradient accumulation over the rank's micro-batches."""

    def __init__(self, argv: list[str], world_size: int, adamw: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # PlainGPT returns a view ([b, s] of the [s, b] loss); nothing writes to it in place
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* view tensor")
        self.configs = configs = parse_megatron_args(argv, world_size)
        self.world_size, self.rank = world_size, dist.get_rank()
        (initial,) = build_model_chunks_for(configs, ParallelState.single())  # seed-identical
        self.model = model = reference_from_megapipe(initial).train()
        del initial
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.params = params = list(model.parameters())
        opt = configs.optimizer
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}[adamw]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() > 1], "weight_decay": opt.weight_decay},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
            ],
            lr=configs.training.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
            **kind,
        )
        self.data = build_batch_source(configs)
        self.num_microbatches = configs.training.num_microbatches(world_size)
        self.iteration = 0

    def step(self) -> tuple[float, float]:
        training, m = self.configs.training, self.num_microbatches
        losses = []
        for micro_batch in range(m):
            indices = micro_batch_range(
                self.iteration,
                micro_batch,
                global_batch_size=training.global_batch_size,
                micro_batch_size=training.micro_batch_size,
                data_parallel_rank=self.rank,
                data_parallel_size=self.world_size,
            )
            batch = self.data.batch(indices)
            loss = masked_mean(self.model(batch.tokens, batch.labels), batch.loss_mask)
            (loss / m).backward()
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()  # the global batch's mean loss, as megapipe logs it
        dist.all_reduce(mean)
        mean /= self.world_size
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.configs.optimizer.clip_grad)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return float(mean), float(norm)


def _build(args: argparse.Namespace, world_size: int) -> dict:
    runs = {PLAIN: PlainFSDP2Run(megapipe_argv(args, [], world_size), world_size, args.plain_adamw)}
    for name in args.variant_list:
        runs[name] = MegapipeRun(megapipe_argv(args, VARIANT_FLAGS[name], world_size), world_size)
    return runs


def _timing_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    runs = _build(args, world_size)
    history, times = rotating_rounds({n: r.step for n, r in runs.items()}, args)
    num_params = sum(p.numel() for p in runs[PLAIN].model.parameters())
    return {"times": times, "history": history, "num_params": num_params}


def _profile_rank(rank: int, world_size: int, args: argparse.Namespace) -> str:
    """cProfile of `args.steps` steps of each variant in --profile (rank 0's report)."""
    torch.set_num_threads(1)
    runs = _build(args, world_size)
    report = []
    for name in args.profile_list:
        for _ in range(args.warmup):
            runs[name].step()
        dist.barrier()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            runs[name].step()
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
        stats.print_stats(args.profile_top)
        stats.sort_stats("cumulative").print_stats(args.profile_top)
        report.append(f"===== {name}: {args.steps} steps, rank {rank} =====\n{out.getvalue()}")
    return "\n".join(report)


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def run_timing(args: argparse.Namespace) -> dict:
    per_rank = run_distributed(_timing_rank, 2, args, timeout=args.timeout)
    names = list(per_rank[0]["times"])
    rounds = []  # a step's time is the slower rank's; a round's, the median of its steps
    for r in range(args.rounds):
        row = {"round": r}
        for name in names:
            steps = [[rank["times"][name][r][s] for rank in per_rank] for s in range(args.steps)]
            row[f"{name}_step_ms"] = [max(wall for wall, _ in ranks) for ranks in steps]
            row[f"{name}_ms"] = statistics.median(row[f"{name}_step_ms"])
            row[f"{name}_cpu_ms"] = statistics.median(
                statistics.mean(cpu for _, cpu in ranks) for ranks in steps
            )
        rounds.append(row)
    summary = {
        name: {
            "median_ms": statistics.median(x[f"{name}_ms"] for x in rounds),
            "best_ms": min(t for x in rounds for t in x[f"{name}_step_ms"]),
            "median_cpu_ms": statistics.median(x[f"{name}_cpu_ms"] for x in rounds),
        }
        for name in names
    }
    comparisons = []
    for label, top, bottom, target in COMPARISONS:
        if top not in names or bottom not in names:
            continue
        ratios = [x[f"{top}_ms"] / x[f"{bottom}_ms"] for x in rounds]
        cpu = [x[f"{top}_cpu_ms"] / x[f"{bottom}_cpu_ms"] for x in rounds]
        comparisons.append(
            {
                "what": label,
                "numerator": top,
                "denominator": bottom,
                "median_ratio": statistics.median(ratios),
                "ratio_quartiles": _quartiles(ratios),
                "median_cpu_ratio": statistics.median(cpu),
                "target": target,
            }
        )
    history = per_rank[0]["history"]
    loss0, norm0 = history[PLAIN][0]
    agreement = {
        name: {
            "step0_loss": history[name][0][0],
            "step0_grad_norm": history[name][0][1],
            "step0_loss_rel_diff": abs(history[name][0][0] - loss0) / abs(loss0),
            "step0_grad_norm_rel_diff": abs(history[name][0][1] - norm0) / abs(norm0),
            "last_loss": history[name][-1][0],
        }
        for name in names
    }
    return {
        "names": names,
        "steps_per_variant": len(history[PLAIN]),
        "num_params": per_rank[0]["num_params"],
        "rounds": rounds,
        "summary": summary,
        "comparisons": comparisons,
        "agreement": agreement,
    }


def print_timing(args: argparse.Namespace, t: dict) -> None:
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab}, {t['num_params']:,} params; DP=2, micro-batch {args.micro_batch} "
        f"x {args.microbatches} micro-batches per rank; plain side: torch AdamW "
        f"({args.plain_adamw}) on FSDP2's DTensors"
    )
    print(
        f"{args.warmup} warm-up steps each; {args.rounds} rounds x {args.steps} steps each, "
        "rotating order; ms = slower rank, median of the round's steps\n"
    )
    names = t["names"]
    print(f"{'variant':<16}{'median ms':>10}{'best ms':>9}{'CPU ms':>9}  step-0 loss, grad norm")
    for n in names:
        s, a = t["summary"][n], t["agreement"][n]
        print(
            f"{n:<16}{s['median_ms']:>10.1f}{s['best_ms']:>9.1f}{s['median_cpu_ms']:>9.1f}  "
            f"{a['step0_loss']:.6f}, {a['step0_grad_norm']:.6f}"
        )
    print(f"\n{'comparison':<52}{'ratio':>7}{'IQR':>13}{'CPU ratio':>11}{'target':>8}")
    for c in t["comparisons"]:
        iqr = f"{c['ratio_quartiles'][0]:.3f}-{c['ratio_quartiles'][1]:.3f}"
        target = "" if c["target"] is None else f"<= {c['target']:g}"
        print(
            f"{c['what']:<52}{c['median_ratio']:>7.3f}{iqr:>13}"
            f"{c['median_cpu_ratio']:>11.3f}{target:>8}"
        )
    worst_loss = max(a["step0_loss_rel_diff"] for a in t["agreement"].values())
    worst_norm = max(a["step0_grad_norm_rel_diff"] for a in t["agreement"].values())
    print(
        "\nratio: median over rounds of the round's wall-time ratio (IQR: its interquartile "
        "range); CPU: process CPU time per step (mean of the ranks).\nstep 0 (same weights, "
        f"same batch): every variant within {worst_loss:.1e} (loss) and {worst_norm:.1e} "
        f"(grad norm) of the plain FSDP2 loop (checked: {LOSS_TOLERANCE:g})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--vocab", type=int, default=4096, help="a multiple of 128 (no padding)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plain-adamw", choices=("fused", "foreach"), default="fused")
    p.add_argument(
        "--variants",
        default=",".join(VARIANT_FLAGS),
        help=f"comma-separated megapipe variants of {', '.join(VARIANT_FLAGS)}",
    )
    p.add_argument(
        "--profile",
        default="",
        help=f"comma-separated variants (of {PLAIN}, ...) to cProfile on rank 0 instead of timing",
    )
    p.add_argument("--profile-top", type=int, default=25, help="rows of each profile table")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the distributed run")
    add_round_args(p, warmup=2, rounds=12, steps=2, default_json=DEFAULT_JSON)
    p.add_argument("--output", dest="json", help="the same as --json")
    args = parse_round_args(p, argv)
    args.variant_list = [v for v in args.variants.split(",") if v]
    args.profile_list = [v for v in args.profile.split(",") if v]
    unknown = [v for v in args.variant_list if v not in VARIANT_FLAGS]
    unknown += [v for v in args.profile_list if v not in (PLAIN, *args.variant_list)]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {PLAIN}, {', '.join(VARIANT_FLAGS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(
        f"megapipe sharded data-parallel benchmark: torch {torch.__version__}, 2 ranks x 1 "
        f"thread (gloo), {platform.machine()} ({os.cpu_count()} cpus)"
    )
    if args.profile_list:
        print(run_distributed(_profile_rank, 2, args, timeout=args.timeout)[0])
        return {}
    start = time.perf_counter()
    timing = run_timing(args)
    print_timing(args, timing)
    print(f"({time.perf_counter() - start:.0f} s)")
    result = {
        "benchmark": "fsdp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {
            k: v
            for k, v in vars(args).items()
            if k not in ("json", "variant_list", "profile_list", "profile", "profile_top")
        },
        **timing,
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    failures = [
        f"{name}: step-0 {key} {a[key]:.2e} > {LOSS_TOLERANCE:g}"
        for name, a in timing["agreement"].items()
        for key in ("step0_loss_rel_diff", "step0_grad_norm_rel_diff")
        if a[key] > LOSS_TOLERANCE
    ]
    if failures:
        raise SystemExit("benchmark checks failed: " + "; ".join(failures))
    return result


if __name__ == "__main__":
    main()
