"""The TP linear that owns its backward, at TP=2 with sequence parallelism: step time and memory.

Two forked gloo ranks (one thread each) hold three copies of the same GPTModel (same weights),
each with a GradBuffer (fp32 main_grad, overlapped bucket reduction armed as in training):

* `autograd`: the layers' forward as it was before the Function (commit 2e72935): the input
  enters through `gather_from_sequence_parallel_region` / `copy_to_tp_region`, then `F.linear`
  and `F.embedding`; every gradient goes through autograd and the post-accumulate hook (the
  benchmark un-claims the parameters so that the buffer takes them through the hook);
* `owned`: the layers as they are: the local sequence shard saved, gathered again in backward
  overlapping dX, dX reduce-scattered overlapping dW, dW multiplied into main_grad;
* `owned-no-overlap`: `owned` with --no-async-tensor-model-parallel-allreduce: each backward
  collective is waited for as soon as it starts (the overlap measured off);
* `owned-deferred`: the same with backward under `WeightGradStore.deferring()` and
  `compute_weight_grads()` after the micro-batches (the zero-bubble API; same work, moved).

One timed step: `--microbatches` forward + backward passes, `finish_grad_sync`, `reset`; no
optimizer (the same for all). Its time is the slower rank's, from a barrier. Variants rotate
over rounds; the headline is the median over rounds of the per-round ratio to `autograd`.
Before timing, every variant's main_grads are checked against `autograd`'s (1e-5 relative), and
the bytes autograd saves in one micro-batch's forward (distinct storages, parameters excluded,
`torch.autograd.graph.saved_tensors_hooks`) are counted per variant.

    python benchmarks/bench_tp_linear.py          # ~2 minutes on 2 cores
    python benchmarks/bench_tp_linear.py --quick  # smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.atomic_files import write_json
from megapipe.config import ModelConfig
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megapipe.layers.cross_entropy import masked_mean
from megapipe.layers.linear import set_tp_comm_overlap
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model import GPTModel
from megapipe.model.activation_memory import saved_activation_bytes
from megapipe.parallel import mappings
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "tp_linear.json")
VARIANTS = ("autograd", "owned", "owned-no-overlap", "owned-deferred")
GRAD_TOLERANCE = 1e-5

# --------------------------------------------------------------------------------------------
# The layers' forward before they owned their backward (commit 2e72935), for the baseline.
# --------------------------------------------------------------------------------------------


def _column_forward(self, x):
    if self.sequence_parallel:
        x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
    else:
        x = mappings.copy_to_tp_region(x, self.tp_group)
    y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
    if self.gather_output:
        y = mappings.gather_from_tp_region(y, self.tp_group)
    return y, (self.bias if self.skip_bias_add else None)


def _row_forward(self, x):
    if self.tp_group.size == 1 and not self.skip_bias_add:
        return F.linear(x, self.weight, self.bias), None
    y = F.linear(x, self.weight)
    if self.sequence_parallel:
        y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
    else:
        y = mappings.reduce_from_tp_region(y, self.tp_group)
    if self.skip_bias_add:
        return y, self.bias
    return (y + self.bias if self.bias is not None else y), None


def _embedding_forward(self, ids):
    if self.tp_group.size == 1:
        return F.embedding(ids, self.weight)
    outside = (ids < self.start) | (ids >= self.end)
    local = (ids - self.start).masked_fill(outside, 0)
    partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return mappings.reduce_from_tp_region(partial, self.tp_group)


def use_autograd_layers(model: torch.nn.Module) -> None:
    """Give `model` the old forward and un-claim its parameters (autograd owns them again)."""
    old = {
        ColumnParallelLinear: _column_forward,
        RowParallelLinear: _row_forward,
        VocabParallelEmbedding: _embedding_forward,
    }
    for module in model.modules():
        if type(module) in old:
            module.forward = types.MethodType(old[type(module)], module)
    for param in model.parameters():
        param.weight_grad_claims = 0


# --------------------------------------------------------------------------------------------
# One rank.
# --------------------------------------------------------------------------------------------


class Variant:
    def __init__(self, name: str, args: argparse.Namespace, state: ParallelState) -> None:
        config = ModelConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            vocab_size=args.vocab,
            seq_length=args.seq,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        rng = RNGTracker(args.seed, tp_rank=state.tp_rank)
        self.model = GPTModel(config, state, rng, seed=args.seed, sequence_parallel=True)
        if name == "autograd":
            use_autograd_layers(self.model)
        set_tp_comm_overlap(self.model, name != "owned-no-overlap")
        self.store = WeightGradStore().attach(self.model)
        self.deferred = name == "owned-deferred"
        self.buffer = GradBuffer(
            list(self.model.parameters()),
            state.dp,
            num_microbatches=args.microbatches,
            overlap=True,
            solo=[self.model.shared_word_embedding()],
        )
        g = torch.Generator().manual_seed(args.seed)
        shape = (args.microbatches, args.micro_batch, args.seq + 1)
        self.tokens = torch.randint(0, args.vocab, shape, generator=g)
        self.mask = torch.ones(args.micro_batch, args.seq)

    def loss(self, microbatch: int) -> torch.Tensor:
        tokens = self.tokens[microbatch]
        per_token = self.model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
        return masked_mean(per_token, self.mask) / len(self.tokens)

    def step(self, keep: bool = False) -> torch.Tensor | None:
        for microbatch in range(len(self.tokens)):
            loss = self.loss(microbatch)
            with self.store.deferring() if self.deferred else contextlib.nullcontext():
                loss.backward()
        if self.deferred:
            self.store.compute_weight_grads()
        self.buffer.finish_grad_sync()
        grads = self.buffer.grad_data.clone() if keep else None
        self.buffer.reset()
        return grads

    def saved_bytes(self) -> int:
        # no backward: the graph and what it saved go with the loss
        return saved_activation_bytes(lambda: self.loss(0), self.model.parameters())


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    state = ParallelState.build(tensor_model_parallel_size=2)
    variants = {name: Variant(name, args, state) for name in VARIANTS}
    reference = variants["autograd"].step(keep=True)
    errors = {n: relative_error(v.step(keep=True), reference) for n, v in variants.items()}
    saved = {n: v.saved_bytes() for n, v in variants.items()}
    times: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in VARIANTS}

    def timed(name: str) -> tuple[float, float]:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        variants[name].step()
        return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3

    for name in VARIANTS:
        for _ in range(args.warmup):
            timed(name)
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            times[name].append([timed(name) for _ in range(args.steps)])
    return {"times": times, "errors": errors, "saved": saved}


def summarize(args: argparse.Namespace, per_rank: list[dict]) -> dict:
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in VARIANTS:
            steps = [[rank["times"][name][r][s] for rank in per_rank] for s in range(args.steps)]
            row[name] = statistics.median(max(wall for wall, _ in ranks) for ranks in steps)
            # CPU time (all threads of a rank, gloo's included, averaged over ranks) is work
            # done, whatever the waiting: steadier than wall time on a shared machine.
            row[f"{name}_cpu"] = statistics.median(
                statistics.mean(cpu for _, cpu in ranks) for ranks in steps
            )
        rounds.append(row)
    summary = {}
    for name in VARIANTS:
        ratios = [row[name] / row["autograd"] for row in rounds]
        med = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med,) * 3
        summary[name] = {
            "median_ms": statistics.median(row[name] for row in rounds),
            "best_ms": min(
                wall for rank in per_rank for steps in rank["times"][name] for wall, _ in steps
            ),
            "median_cpu_ms": statistics.median(row[f"{name}_cpu"] for row in rounds),
            "median_cpu_ratio": statistics.median(
                row[f"{name}_cpu"] / row["autograd_cpu"] for row in rounds
            ),
            "median_ratio": med,
            "ratio_quartiles": [q1, q3],
            "saved_bytes_per_microbatch": per_rank[0]["saved"][name],
            "grad_error_vs_autograd": max(rank["errors"][name] for rank in per_rank),
        }
    return {"rounds": rounds, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--rounds", type=int, default=20, help="rotating timed rounds")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the distributed run")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    p.add_argument("--quick", action="store_true", help="1 warm-up step, 3 rounds of 1 step")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 3, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(
        f"TP linear benchmark: torch {torch.__version__}, TP=2 + SP, 2 ranks x 1 thread (gloo), "
        f"{platform.machine()} ({os.cpu_count()} cpus)"
    )
    start = time.perf_counter()
    result = summarize(args, run_distributed(_rank, 2, args, timeout=args.timeout))
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq "
        f"{args.seq}, micro-batch {args.micro_batch} x {args.microbatches} micro-batches, "
        f"vocab {args.vocab}; {args.warmup} warm-up steps, {args.rounds} rounds x {args.steps} "
        "steps, rotating; ms = slower rank, median of the round's steps\n"
    )
    print(f"{'variant':16} {'median ms':>9} {'best ms':>8} {'ratio':>6} {'IQR':>12} "
          f"{'CPU ms':>7} {'CPU ratio':>9} {'saved MB/mb':>11} {'grad err':>9}")  # fmt: skip
    for name, s in result["summary"].items():
        q1, q3 = s["ratio_quartiles"]
        print(
            f"{name:16} {s['median_ms']:9.1f} {s['best_ms']:8.1f} {s['median_ratio']:6.3f} "
            f"{q1:5.3f}-{q3:5.3f} {s['median_cpu_ms']:7.1f} {s['median_cpu_ratio']:9.3f} "
            f"{s['saved_bytes_per_microbatch'] / 2**20:11.2f} {s['grad_error_vs_autograd']:9.1e}"
        )
    print(f"({time.perf_counter() - start:.0f} s)")
    result.update(
        benchmark="tp_linear",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        machine={"arch": platform.machine(), "cpus": os.cpu_count()},
        config={k: v for k, v in vars(args).items() if k != "json"},
    )
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    bad = {n: s["grad_error_vs_autograd"] for n, s in result["summary"].items()}
    if max(bad.values()) > GRAD_TOLERANCE:
        raise SystemExit(f"main_grads differ from the autograd variant's: {bad}")
    return result


if __name__ == "__main__":
    main()
