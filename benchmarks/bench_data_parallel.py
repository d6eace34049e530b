"""Data parallelism: megapipe's DP=2 training step against torch DDP, and memory per rank.

Part 1, step time. Two gloo ranks (forked, one thread each) hold, side by side, one model per
variant, all initialised to the same weights:
* `ddp`: `torch.nn.parallel.DistributedDataParallel` wrapping megapipe's single-rank GPTModel
  (built with `ParallelState.single()`), `torch.optim.AdamW` and
  `torch.nn.utils.clip_grad_norm_`, gradient accumulation with `no_sync` on all but the last
  micro-batch;
* `megapipe`, `megapipe-overlap`, `megapipe-distopt`, `megapipe-distopt-overlap`,
  `megapipe-distopt-overlap-gather`: the product's own `train_step` (pipeline executor,
  GradBuffer, ShardedOptimizer), built from parsed Megatron flags as `pretrain_gpt.py` builds
  it: plain, with `--overlap-grad-reduce`, with `--use-distributed-optimizer`, with both, and
  with `--overlap-param-gather` added (the parameter all-gather left running into the next
  step's forward: that step's time includes whatever of it the forward waits for).
Every variant trains on the same global batches (mock data, iteration n = the variant's n-th
step), with the same AdamW hyper-parameters (no weight decay for 1-D parameters, as megapipe),
the same clipping, and the same bucket size (`--bucket-mb`: DDP's `bucket_cap_mb`, and
megapipe's `--ddp-bucket-size` in fp32 elements). One timed step starts after a barrier and
ends when the optimizer step is done; its time is the slower rank's. After a warm-up, variants
are timed in rotating order over rounds; a round's time is the median of its steps; headline
numbers are medians over rounds of the per-round ratio variant / DDP.

Part 2, memory per rank. For every data-parallel sharding strategy (no_shard; optim = ZeRO-1,
--use-distributed-optimizer; optim_grads = ZeRO-2, --use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads; optim_grads_params = ZeRO-3, --use-torch-fsdp2),
fp32 and bf16 parameters, DP = 1, 2, 4: one training step in freshly forked ranks
(`megapipe.testing.step_memory.measure_step`), measuring
* the bytes per parameter by kind at rest (`state_bytes_per_parameter()`), read after backward
  and the optimizer step but before the optimizer's `zero_grad` (which frees FSDP2's sharded
  gradients), next to the formula for the strategy (`formula_table`);
* under FSDP2, the peak bytes of gathered parameters during the step: the storages of the
  unsharded parameters plus the flat all-gather buffers FSDP2 still holds, sampled right after
  every `FSDPParamGroup.unshard` / `wait_for_unshard` (the only places FSDP2 allocates them),
  next to `pipeline/stage_memory.gathered_parameter_bytes`, the estimate the start-up table and
  `--pipeline-partition memory` use;
* the rank's peak RSS growth (`resource.getrusage`) per parameter.
(FSDP strategies at DP=1 run the plain path, as megapipe does with a shard group of one.)

    python benchmarks/bench_data_parallel.py          # full run: ~2 minutes on 2 cores
    python benchmarks/bench_data_parallel.py --quick  # ~20 s smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import resource
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: ~70 MB, not ours to count)
import torch.distributed as dist
from round_args import rotating_rounds  # noqa: E402  (benchmarks/, the script's own folder)

# Imported here, before ranks are forked: the ranks inherit them, so neither the timed steps
# nor the memory deltas include import work.
from megapipe.arguments import parse_args as parse_megatron_args
from megapipe.atomic_files import write_json
from megapipe.data.sampler import micro_batch_range
from megapipe.data.sources import build_batch_source
from megapipe.layers.cross_entropy import masked_mean
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.stage_memory import MemoryModel
from megapipe.testing import run_distributed
from megapipe.testing.step_memory import measure_step
from megapipe.training.build import build_model_chunks_for
from megapipe.training.step_by_step import Stepper

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "data_parallel.json")
VARIANT_FLAGS = {
    "megapipe": [],
    "megapipe-overlap": ["--overlap-grad-reduce"],
    "megapipe-distopt": ["--use-distributed-optimizer"],
    "megapipe-distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "megapipe-distopt-overlap-gather": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
}
DEFAULT_VARIANTS = (
    "megapipe,megapipe-overlap,megapipe-distopt,megapipe-distopt-overlap,"
    "megapipe-distopt-overlap-gather"
)
LOSS_TOLERANCE = 1e-5  # step 0, relative: loss vs DDP's, grad norm vs float64 norm of DDP's grads


# --------------------------------------------------------------------------------------------
# Building the runs from one set of benchmark flags.
# --------------------------------------------------------------------------------------------


def megapipe_argv(
    args: argparse.Namespace, extra: list[str], *, seq: int, micro_batch: int, global_batch: int
) -> list[str]:
    """The Megatron flags of one megapipe variant (mock data, no dropout)."""
    bucket_elements = max(1, int(args.bucket_mb * 2**20) // 4)  # fp32 main grads
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(seq),
        "--vocab-size", str(args.vocab), "--mock-data",
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", "1000000", "--lr", str(args.lr), "--seed", str(args.seed),
        "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000000",
        "--clip-grad", str(args.clip_grad), "--weight-decay", str(args.weight_decay),
        "--ddp-bucket-size", str(bucket_elements),
        *extra,
    ]  # fmt: skip


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


class MegapipeRun:
    """One megapipe variant on this rank: chunks, executor, optimizer, data, as train() builds."""

    def __init__(
        self,
        argv: list[str],
        world_size: int,
        state: ParallelState | None = None,
        keep_initial: bool = False,
    ) -> None:
        self.configs = configs = parse_megatron_args(argv, world_size)
        self.state = state = state or ParallelState.build(1, 1)
        with _quiet():
            self.stepper = Stepper.build(configs, state)
        self.chunks, self.optimizer = self.stepper.chunks, self.stepper.optimizer
        if keep_initial:  # a copy of the initial weights, to compare with DDP's
            self.initial = {n: p.detach().clone() for n, p in self.chunks[0].named_parameters()}

    def step(self) -> tuple[float, float]:
        result = self.stepper.step()
        return result.lm_loss, result.grad_norm


class DDPRun:
    """torch DDP around megapipe's single-rank GPTModel, with torch AdamW and clip_grad_norm_."""

    def __init__(self, argv: list[str], world_size: int, bucket_mb: float) -> None:
        self.configs = configs = parse_megatron_args(argv, world_size)
        self.world_size = world_size
        self.rank = dist.get_rank()
        (model,) = build_model_chunks_for(configs, ParallelState.single())
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        self.params = list(model.parameters())
        opt = configs.optimizer
        groups = [  # megapipe's (and Megatron's) rule: no weight decay for biases and norms
            {"params": [p for p in self.params if p.dim() > 1], "weight_decay": opt.weight_decay},
            {"params": [p for p in self.params if p.dim() <= 1], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=configs.training.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps
        )
        self.data = build_batch_source(configs)
        self.num_microbatches = configs.training.num_microbatches(world_size)
        self.iteration = 0
        self.exact_norm0: float | None = None

    def step(self) -> tuple[float, float]:
        training = self.configs.training
        m = self.num_microbatches
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
            sync = self.model.no_sync() if micro_batch < m - 1 else contextlib.nullcontext()
            with sync:
                loss = masked_mean(
                    self.model(tokens=batch.tokens, labels=batch.labels), batch.loss_mask
                )
                (loss / m).backward()
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()  # the global batch's mean loss, as megapipe logs it
        dist.all_reduce(mean)
        mean /= self.world_size
        if self.exact_norm0 is None:  # step 0 only: the float64 norm of DDP's gradients
            squares = [p.grad.double().pow(2).sum() for p in self.params if p.grad is not None]
            self.exact_norm0 = float(torch.stack(squares).sum().sqrt())
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.configs.optimizer.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return float(mean), float(norm)


# --------------------------------------------------------------------------------------------
# Part 1: step time (runs on every rank).
# --------------------------------------------------------------------------------------------


def _timing_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    m = args.microbatches
    shape = {"seq": args.seq, "micro_batch": args.micro_batch}
    shape["global_batch"] = args.micro_batch * world_size * m
    runs: dict[str, MegapipeRun | DDPRun] = {
        "ddp": DDPRun(megapipe_argv(args, [], **shape), world_size, args.bucket_mb)
    }
    for name in args.variant_list:
        argv = megapipe_argv(args, VARIANT_FLAGS[name], **shape)
        runs[name] = MegapipeRun(argv, world_size, keep_initial=True)
    reference = runs["ddp"].initial
    for name, run in runs.items():  # seed-identical weights, parameter by parameter
        if run.initial.keys() != reference.keys():
            raise RuntimeError(f"{name}: parameter names differ from the DDP model's")
        for key, value in run.initial.items():
            if not torch.equal(value, reference[key]):
                raise RuntimeError(f"{name}: initial {key} differs from the DDP model's")
        del run.initial
    num_params = sum(p.numel() for p in runs["ddp"].params)
    buckets = {n: len(r.optimizer.buffers[0].buckets) for n, r in runs.items() if n != "ddp"}

    history, times = rotating_rounds({n: r.step for n, r in runs.items()}, args)
    return {
        "times": times,
        "history": history,
        "ddp_exact_step0_grad_norm": runs["ddp"].exact_norm0,
        "num_params": num_params,
        "buckets": buckets,
        "num_microbatches": m,
        "global_batch": shape["global_batch"],
    }


def run_timing(args: argparse.Namespace) -> dict:
    per_rank = run_distributed(_timing_rank, 2, args, timeout=args.timeout)
    first = per_rank[0]
    names = list(first["times"])
    # A step's time is the slower rank's; a round's, the median of its steps.
    rounds = []
    for r in range(args.rounds):
        row = {"round": r}
        for name in names:
            steps = [[rank["times"][name][r][s] for rank in per_rank] for s in range(args.steps)]
            row[f"{name}_step_ms"] = [max(wall for wall, _ in ranks) for ranks in steps]
            row[f"{name}_ms"] = statistics.median(row[f"{name}_step_ms"])
            # CPU time (all threads of a rank, averaged over ranks) is work done, whatever the
            # waiting: less sensitive than wall time to other load on a shared machine.
            row[f"{name}_cpu_ms"] = statistics.median(
                statistics.mean(cpu for _, cpu in ranks) for ranks in steps
            )
        rounds.append(row)
    summary = {}
    for name in names:
        ratios = [x[f"{name}_ms"] / x["ddp_ms"] for x in rounds]
        med = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med,) * 3
        cpu_ratios = [x[f"{name}_cpu_ms"] / x["ddp_cpu_ms"] for x in rounds]
        summary[name] = {
            "median_ms": statistics.median(x[f"{name}_ms"] for x in rounds),
            "median_cpu_ms": statistics.median(x[f"{name}_cpu_ms"] for x in rounds),
            "median_cpu_ratio": statistics.median(cpu_ratios),
            "best_ms": min(t for x in rounds for t in x[f"{name}_step_ms"]),
            "median_ratio": med,
            "ratio_quartiles": [q1, q3],
        }
    # Same batches, same weights, same math: step 0 must agree; later steps drift only by
    # rounding (different reduction orders), which Adam amplifies a little.
    history = first["history"]
    loss0, norm0 = history["ddp"][0]
    exact = first["ddp_exact_step0_grad_norm"]  # float64 norm of DDP's step-0 gradients
    agreement = {}
    for name in names:
        loss, norm = history[name][0]
        drift = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(history[name], history["ddp"]))
        agreement[name] = {
            "step0_loss": loss,
            "step0_grad_norm": norm,
            "step0_loss_rel_diff": abs(loss - loss0) / abs(loss0),
            "step0_grad_norm_rel_diff": abs(norm - norm0) / abs(norm0),
            "step0_grad_norm_rel_diff_vs_float64": abs(norm - exact) / exact,
            "max_loss_rel_diff_all_steps": drift,
            "last_loss": history[name][-1][0],
        }
    return {
        "names": names,
        "steps_per_variant": len(history["ddp"]),
        "rounds": rounds,
        "summary": summary,
        "agreement": agreement,
        "num_params": first["num_params"],
        "buckets": first["buckets"],
        "num_microbatches": first["num_microbatches"],
        "global_batch": first["global_batch"],
    }


def print_timing(args: argparse.Namespace, t: dict) -> None:
    names = t["names"]
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab}, {t['num_params']:,} params; DP=2, micro-batch {args.micro_batch} x "
        f"{t['num_microbatches']} micro-batches per rank (global batch {t['global_batch']}); "
        f"bucket {args.bucket_mb:g} MB (megapipe buckets: "
        + ", ".join(f"{n} {b}" for n, b in t["buckets"].items())
        + ")"
    )
    print(
        f"{args.warmup} warm-up steps each; {args.rounds} rounds x {args.steps} steps each, "
        "rotating order; ms = slower rank, median of the round's steps\n"
    )
    short = {n: n.replace("megapipe", "mp") for n in names}
    print(f"{'round':>5}  " + "  ".join(f"{short[n]:>16}" for n in names))
    for x in t["rounds"]:
        print(f"{x['round']:>5}  " + "  ".join(f"{x[n + '_ms']:>16.1f}" for n in names))
    print()
    print(
        f"{'variant':<26}{'median ms':>10}{'best ms':>9}{'ratio vs DDP':>14}{'IQR':>13}"
        f"{'CPU ms':>9}{'CPU ratio':>11}"
    )
    for n in names:
        s = t["summary"][n]
        ratio, iqr, cpu_ratio = "1", "", "1"
        if n != "ddp":
            ratio, cpu_ratio = f"{s['median_ratio']:.3f}", f"{s['median_cpu_ratio']:.3f}"
            iqr = f"{s['ratio_quartiles'][0]:.3f}-{s['ratio_quartiles'][1]:.3f}"
        print(
            f"{n:<26}{s['median_ms']:>10.1f}{s['best_ms']:>9.1f}{ratio:>14}{iqr:>13}"
            f"{s['median_cpu_ms']:>9.1f}{cpu_ratio:>11}"
        )
    print(
        "\nratio: median over rounds of the round's variant / DDP wall-time ratio (IQR: its "
        "interquartile range); CPU: process CPU time per step (all threads, mean of the ranks)"
    )
    agreement = t["agreement"]
    megapipe = [n for n in names if n != "ddp"]
    worst_loss0 = max(agreement[n]["step0_loss_rel_diff"] for n in megapipe)
    worst_norm0 = max(agreement[n]["step0_grad_norm_rel_diff"] for n in megapipe)
    worst_exact = max(agreement[n]["step0_grad_norm_rel_diff_vs_float64"] for n in megapipe)
    worst = max(agreement[n]["max_loss_rel_diff_all_steps"] for n in megapipe)
    print(
        f"step 0 (same weights, same batch): DDP loss {agreement['ddp']['step0_loss']:.6f}, "
        f"grad norm {agreement['ddp']['step0_grad_norm']:.6f}; megapipe variants within "
        f"{worst_loss0:.1e} (loss) and {worst_norm0:.1e} (grad norm) of DDP.\nmegapipe's "
        f"grad norms are within {worst_exact:.1e} of the float64 norm of DDP's gradients "
        f"(loss and this checked: {LOSS_TOLERANCE:g}), torch's fp32 clip_grad_norm_ within "
        f"{agreement['ddp']['step0_grad_norm_rel_diff_vs_float64']:.1e}. Largest relative "
        f"loss difference from DDP over all {t['steps_per_variant']} steps: {worst:.1e}"
    )


# --------------------------------------------------------------------------------------------
# Part 2: memory per rank (fresh forked ranks per configuration).
# --------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


STRATEGY_FLAGS = {
    "no_shard": [],
    "optim": ["--use-distributed-optimizer"],
    "optim_grads": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    "optim_grads_params": ["--use-torch-fsdp2"],
}
ZERO = {
    "no_shard": "DDP",
    "optim": "ZeRO-1",
    "optim_grads": "ZeRO-2",
    "optim_grads_params": "ZeRO-3",
}
KINDS = ("params", "grads", "master", "optimizer")


def _memory_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    state = ParallelState.build(1, 1)  # process groups first: their buffers are not counted
    rss_before = _rss_bytes()
    run = MegapipeRun(argv, world_size, state)
    measured = measure_step(run.stepper)
    estimate = MemoryModel.of(run.configs).stage(0, [run.configs.model.num_layers], 1)
    return {
        **measured,
        "gathered_formula_bytes": estimate.gathered_bytes,
        "peak_rss_delta_bytes": _maxrss_bytes() - rss_before,
    }


def formula_table(dtype: str, strategy: str, d: int) -> dict[str, float]:
    """Bytes per parameter at rest by kind (Adam), for a strategy over d data-parallel ranks.

    bf16 params, fp32 grads: param 2 + grad 4 replicated; fp32 master 4 + Adam m, v 8 = 12:
    18 plain, 6 + 12/d with ZeRO-1 (Megatron-LM's published table). fp32: the param is its own
    master: 16 plain, 8 + 8/d ZeRO-1. ZeRO-2/3 on FSDP2 (megapipe/distributed/fsdp.py): the
    fp32 parameter shard (the master) 4/d, the fp32 gradient shard 4/d, m and v 8/d: 16/d for
    either dtype (Megatron-LM's ZeRO-2 row, 4 + 12/d, keeps the params replicated; FSDP2
    shards them between steps and gathers them during the step, which `gathered` measures).
    A shard group of one rank runs the plain path: no_shard's numbers.
    """
    if strategy in ("optim_grads", "optim_grads_params") and d > 1:
        return {"params": 4 / d, "grads": 4 / d, "master": 0, "optimizer": 8 / d}
    shard = d if strategy == "optim" else 1
    if dtype == "bf16":
        return {"params": 2, "grads": 4, "master": 4 / shard, "optimizer": 8 / shard}
    return {"params": 4, "grads": 4, "master": 0, "optimizer": 8 / shard}


def run_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype in ("fp32", "bf16"):
        for strategy, flags in STRATEGY_FLAGS.items():
            for d in (1, 2, 4):
                extra = (["--bf16"] if dtype == "bf16" else []) + flags
                argv = megapipe_argv(args, extra, seq=args.mem_seq, micro_batch=1, global_batch=d)
                start = time.perf_counter()
                per_rank = run_distributed(_memory_rank, d, argv, timeout=args.timeout)
                first = per_rank[0]
                n = first["num_params"]
                measured, expected = first["bytes_per_param"], formula_table(dtype, strategy, d)
                gathered = max(r["gathered_bytes"] for r in per_rank) / n
                gathered_formula = first["gathered_formula_bytes"] / n
                rows.append(
                    {
                        "dtype": dtype,
                        "strategy": strategy,
                        "distributed_optimizer": strategy == "optim",
                        "dp": d,
                        "num_params": n,
                        "measured": measured,
                        "measured_total": sum(measured.values()),
                        "formula": expected,
                        "formula_total": sum(expected.values()),
                        "gathered_measured": gathered,
                        "gathered_parts_bytes": first["gathered_parts"],
                        "gathered_formula": gathered_formula,
                        "measured_peak": sum(measured.values()) + gathered,
                        "formula_peak": sum(expected.values()) + gathered_formula,
                        "peak_rss_delta_bytes_per_param": max(
                            r["peak_rss_delta_bytes"] for r in per_rank
                        )
                        / n,
                        "wall_s": time.perf_counter() - start,
                    }
                )
    return rows


def print_memory(args: argparse.Namespace, rows: list[dict]) -> None:
    print(
        f"\nmemory per rank, bytes per parameter ({rows[0]['num_params']:,} params, "
        f"{args.layers} layers; one step of seq {args.mem_seq}, micro-batch 1 per rank): "
        "measured [formula]. At rest: state_bytes_per_parameter() after backward and the "
        "step, before zero_grad. gathered: FSDP2's peak of gathered parameters + all-gather "
        "buffers [stage_memory.gathered_parameter_bytes]\n"
    )
    print(
        f"{'params':<7}{'strategy':<29}{'DP':>3}{'params':>13}{'grads':>13}{'master':>11}"
        f"{'adam m+v':>13}{'at rest':>15}{'gathered':>15}{'peak':>15}{'RSS delta':>11}"
    )
    for x in rows:
        m, e = x["measured"], x["formula"]
        cells = "".join(
            f"{f'{m[k]:.2f} [{e[k]:.3g}]':>{w}}" for k, w in zip(KINDS, (13, 13, 11, 13))
        )
        total = f"{x['measured_total']:.2f} [{x['formula_total']:.3g}]"
        gathered = f"{x['gathered_measured']:.2f} [{x['gathered_formula']:.2f}]"
        peak = f"{x['measured_peak']:.2f} [{x['formula_peak']:.2f}]"
        label = f"{x['strategy']} ({ZERO[x['strategy']]})"
        print(
            f"{x['dtype']:<7}{label:<29}{x['dp']:>3}{cells}{total:>15}{gathered:>15}{peak:>15}"
            f"{x['peak_rss_delta_bytes_per_param']:>11.1f}"
        )
    print(
        "\nRSS delta: the rank's getrusage peak minus its RSS before building the model, per "
        "parameter; includes the model built before it moves into the flat buffers (or is "
        "sharded), autograd's transient grads, activations, collective buffers and allocator "
        "slack, so read it as a rough upper bound, not as the table's number."
    )


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DDP bucket_cap_mb = megapipe's")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated megapipe variants of {', '.join(VARIANT_FLAGS)}",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--rounds", type=int, default=24, help="rotating timed rounds")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--mem-seq", type=int, default=32, help="sequence length of the memory step")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per distributed run")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    p.add_argument("--quick", action="store_true", help="1 warm-up step, 3 rounds of 1 step")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 3, 1
    args.variant_list = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variant_list if v not in VARIANT_FLAGS]
    if unknown:
        p.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANT_FLAGS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(
        f"megapipe data-parallel benchmark: torch {torch.__version__}, 2 ranks x 1 thread (gloo), "
        f"{platform.machine()} ({os.cpu_count()} cpus)"
    )
    result = {
        "benchmark": "data_parallel",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "variant_list")},
    }
    failures = []
    if not args.skip_timing:
        start = time.perf_counter()
        timing = run_timing(args)
        print_timing(args, timing)
        print(f"(timing part: {time.perf_counter() - start:.0f} s)")
        result["timing"] = timing
        checked = ("step0_loss_rel_diff", "step0_grad_norm_rel_diff_vs_float64")
        for name, a in timing["agreement"].items():
            for key in checked if name != "ddp" else ():
                if a[key] > LOSS_TOLERANCE:
                    failures.append(f"{name}: {key} {a[key]:.2e} > {LOSS_TOLERANCE:g}")
    if not args.skip_memory:
        start = time.perf_counter()
        memory = run_memory(args)
        print_memory(args, memory)
        print(f"(memory part: {time.perf_counter() - start:.0f} s)")
        result["memory"] = memory
        for x in memory:  # the kinds must add up to the formula (bucket padding aside)
            what = f"{x['dtype']} {x['strategy']} DP={x['dp']}"
            if abs(x["measured_total"] - x["formula_total"]) > 0.05:
                failures.append(
                    f"{what}: {x['measured_total']:.2f} bytes/param at rest, formula "
                    f"{x['formula_total']:.3g}"
                )
            if abs(x["gathered_measured"] - x["gathered_formula"]) > 0.01 * x["formula_peak"]:
                failures.append(
                    f"{what}: gathered {x['gathered_measured']:.2f} bytes/param, formula "
                    f"{x['gathered_formula']:.2f}"
                )
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if failures:
        raise SystemExit("benchmark checks failed: " + "; ".join(failures))
    return result


if __name__ == "__main__":
    main()
