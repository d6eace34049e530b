"""Pipeline benchmark: megapipe's 1F1B, interleaved and zero-bubble executors against torch's.

PP=2 on the CPU (gloo, one forked process per rank, one intra-op thread each) with m
micro-batches of the same small GPT (untied embeddings, dropout 0), split the same way for
every variant: each rank holds the same layers (and with v=2 chunks, the same chunk layers).
Variants, all in one run:

- single: one process with all layers, gradient accumulation over the m micro-batches;
- megapipe-1f1b / -interleaved / -zero-bubble / -interleaved-zb: megapipe's PipelineExecutor
  (1f1b, interleaved-1f1b with v=2, zero-bubble-h1, interleaved-zero-bubble with v=2), each also
  `-ahead`: with receives moved one unit early over units that send nothing
  (`build_schedule(..., post_ahead=True)`, pretrain_gpt's default), and `-before`: with every
  receive one unit early whatever the unit sends (megapipe's default before it relied only on
  what NCCL promises, `megapipe.testing.posting_before`; gloo forgives it, NCCL may not);
- torch-1f1b / -interleaved / -zero-bubble / -interleaved-zb: torch.distributed.pipelining's
  PipelineStage with Schedule1F1B / ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (one
  stage per rank: its ZB1P, i.e. ZB-H1) / ScheduleInterleavedZeroBubble (two), on the same
  GPTModel chunks and the same loss.

One step is the forward and backward of all m micro-batches plus a torch.optim.Adam step and
zero_grad (the same loss scaling everywhere: each micro-batch's mean loss / m). After warm-up,
variants are timed in rounds whose order rotates, so drifts of a noisy machine hit all alike;
a round's pipeline time is the slowest rank's. Medians over rounds are reported, with
efficiency = single / (p x pipeline step) beside the bubble bound m/(m+p-1) (1F1B) or
v*m/(v*m+p-1) (interleaved), and for the zero-bubble kinds 1 / (1 + the simulated bubble) under
the paper's cost model F = B = W (ZB-H1: 3m/(3m+p-1)).

Then a diagnosis: a few more steps of each megapipe variant with a trace, whose measured
compute durations are replayed in the schedule simulator with free transfers. Its makespan is
what the schedule would take with this model's real costs (imbalance between stages, W
smaller than B) if communication and the executor cost nothing; the traced step over it is
the executor's and transport's share of the loss.

    python benchmarks/bench_pipeline.py            # full run, about 2-3 minutes on 2 cores
    python benchmarks/bench_pipeline.py --quick    # a smoke test, too short to trust
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megapipe.atomic_files import write_json
from megapipe.config import ModelConfig
from megapipe.data.batch import TrainingBatch
from megapipe.layers.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import ZERO_BUBBLE_KINDS, build_schedule
from megapipe.pipeline.timeline import (
    Timeline,
    boxes_from_trace,
    replayed_makespan,
    theoretical_efficiency,
)
from megapipe.pipeline.trace import TraceRecorder, chrome_trace
from megapipe.testing import run_distributed
from megapipe.testing.posting_before import receives_one_unit_early

PP = 2
SEED = 1234
KINDS = {  # variant suffix -> (megapipe schedule, chunks per rank)
    "1f1b": ("1f1b", 1),
    "interleaved": ("interleaved-1f1b", 2),
    "zero-bubble": ("zero-bubble-h1", 1),
    "interleaved-zb": ("interleaved-zero-bubble", 2),
}
MODES = ("", "-ahead", "-before")  # megapipe variant suffix: the receives' posting
VARIANTS = (
    "single",
    "single-x2",
    *(f"megapipe-{k}{mode}" for k in KINDS for mode in MODES),
    *(f"torch-{k}" for k in KINDS),
)
PIPELINES = VARIANTS[2:]
DIAGNOSED_STEPS = 3  # traced steps per megapipe variant
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "pipeline.json")
Step = Callable[..., float | None]  # one training step; the mean loss where this rank knows it


def variant_kind(name: str) -> tuple[str, str]:
    """`megapipe-interleaved-zb-ahead` -> ("interleaved-zb", "-ahead"): KINDS key, MODES key."""
    rest = name.split("-", 1)[1]
    kind = rest.removesuffix("-ahead").removesuffix("-before")
    return kind, rest[len(kind) :]


def schedule_of(kind: str, v: int, m: int, rank: int, mode: str) -> list:
    """Rank `rank`'s actions for a MODES suffix."""
    if mode == "-before":
        return receives_one_unit_early(kind, PP, v, m, rank)
    return build_schedule(kind, PP, v, m, rank, post_ahead=mode == "-ahead")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=True,  # no tied-embedding sync in either framework
    )


def global_batch(args: argparse.Namespace) -> TrainingBatch:
    """m x micro-batch samples; micro-batch i is rows [i*b, (i+1)*b)."""
    g = torch.Generator().manual_seed(SEED)
    rows = args.microbatches * args.micro_batch
    tokens = torch.randint(0, args.vocab, (rows, args.seq + 1), generator=g)
    mask = torch.ones(rows, args.seq)
    return TrainingBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask)


def micro_batch(batch: TrainingBatch, i: int, size: int) -> TrainingBatch:
    rows = slice(i * size, (i + 1) * size)
    return TrainingBatch(batch.tokens[rows], batch.labels[rows], batch.loss_mask[rows])


def _adam_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def single_step(args: argparse.Namespace, batch: TrainingBatch) -> Step:
    """All layers in this process: gradient accumulation over the m micro-batches."""
    model = GPTModel(model_config(args), ParallelState.single(), RNGTracker(SEED), seed=SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    m = args.microbatches

    def step() -> float:
        total = 0.0
        for i in range(m):
            b = micro_batch(batch, i, args.micro_batch)
            loss = masked_mean(model(tokens=b.tokens, labels=b.labels), b.loss_mask)
            (loss / m).backward()
            total += loss.item()
        _adam_step(optimizer)
        return total / m

    return step


def _chunks(args: argparse.Namespace, state: ParallelState, v: int) -> list[GPTModel]:
    config = model_config(args)
    rng = RNGTracker(SEED, state.tp_rank, state.pp_rank)
    return build_model_chunks(config, state, rng, partition_layers(config, PP, v), seed=SEED)


def megapipe_step(
    args: argparse.Namespace,
    batch: TrainingBatch,
    state: ParallelState,
    kind: str,
    v: int,
    mode: str = "",
) -> Step:
    """A step of megapipe's executor; step(trace=recorder) also records its actions."""
    chunks = _chunks(args, state, v)
    m = args.microbatches
    executor = PipelineExecutor(
        chunks,
        state,
        schedule_of(kind, v, m, state.pp_rank, mode),
        num_microbatches=m,
        activation_shape=activation_shape(model_config(args), args.micro_batch, 1, False),
    )
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=args.lr)

    def step(trace: TraceRecorder | None = None) -> float | None:
        losses = executor.run(lambda i: micro_batch(batch, i, args.micro_batch), trace=trace)
        _adam_step(optimizer)
        return float(torch.stack(losses).mean()) if losses else None

    return step


class StageModule(torch.nn.Module):
    """A GPTModel chunk with the positional signature torch.distributed.pipelining calls."""

    def __init__(self, chunk: GPTModel) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(tokens=x)
        return self.chunk(hidden_states=x)  # the last stage returns logits [s, b, vocab]


def torch_step(
    args: argparse.Namespace, batch: TrainingBatch, state: ParallelState, kind: str, v: int
) -> Step:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    m = args.microbatches
    chunks = _chunks(args, state, v)
    stages = [  # shapes are inferred from the first micro-batch (torch's dynamic mode)
        PipelineStage(
            StageModule(chunk),
            c * PP + state.pp_rank,
            PP * v,
            torch.device("cpu"),
            group=state.pp.pg,
        )
        for c, chunk in enumerate(chunks)
    ]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The same loss megapipe's last stage computes, scaled by 1/m as megapipe does."""
        per_token = vocab_parallel_cross_entropy(logits, labels.t(), Group.single(), 0, args.vocab)
        return masked_mean(per_token.t(), torch.ones_like(labels, dtype=torch.float32)) / m

    if kind in ("zero-bubble-h1", "interleaved-zero-bubble"):
        schedule = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn, scale_grads=False)
    elif v == 1:
        schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=args.lr)
    first, last = state.is_first_stage, state.is_last_stage

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        inputs = (batch.tokens,) if first else ()
        target = batch.labels if last else None
        schedule.step(*inputs, target=target, losses=losses if last else None)
        _adam_step(optimizer)
        return float(torch.stack(losses).detach().mean()) * m if last else None

    return step


def _build_steps(args: argparse.Namespace, state: ParallelState) -> dict[str, Step | None]:
    batch = global_batch(args)
    single = single_step(args, batch)
    steps: dict[str, Step | None] = {
        "single": single if state.pp_rank == 0 else None,
        "single-x2": single,  # every rank at once: how well this machine runs 2 processes
    }
    for name, (kind, v) in KINDS.items():
        for mode in MODES:
            steps[f"megapipe-{name}{mode}"] = megapipe_step(args, batch, state, kind, v, mode)
        steps[f"torch-{name}"] = torch_step(args, batch, state, kind, v)
    return steps


def _system_busy_s() -> float | None:
    """CPU seconds all processes on this machine have run (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _timed(step: Step | None, n: int, pause_s: float = 0.0) -> tuple[float, float, float | None]:
    """Run `n` steps (or sleep `pause_s`) on every rank at once.

    Returns the slowest rank's seconds per step, the CPU cores other processes kept busy
    meanwhile (machine-wide CPU time minus our ranks', over the wall time; NaN where
    unknown), and this rank's last loss.
    """
    dist.barrier()
    loss, busy = None, _system_busy_s()
    start, cpu = time.perf_counter(), time.process_time()
    if step is not None:
        for _ in range(n):
            loss = step()
    time.sleep(pause_s)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ours = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(ours[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(ours[1:], op=dist.ReduceOp.SUM)
    wall, cpu = float(ours[0]), float(ours[1])
    after = _system_busy_s()
    foreign = float("nan") if busy is None or after is None else (after - busy - cpu) / wall
    foreign = torch.tensor([foreign if dist.get_rank() == 0 else 0.0])
    dist.broadcast(foreign, src=0)
    return wall / max(n, 1), float(foreign), loss


def _wait_for_quiet(args: argparse.Namespace) -> None:
    """Sample other processes' load until it is below --quiet-cores or --max-wait passes.

    Rank 0 decides (and broadcasts) when to stop, so that every rank leaves the loop after the
    same sample: ranks deciding by their own clocks could part ways and hang in a collective.
    """
    deadline = time.monotonic() + args.max_wait
    while True:
        load = _timed(None, 0, pause_s=0.3)[1]  # NaN (cannot tell) counts as quiet
        waiting = torch.tensor([float(load > args.quiet_cores and time.monotonic() < deadline)])
        dist.broadcast(waiting, src=0)
        if not waiting.item():
            return
        time.sleep(0.5)


def _clean_timed(step: Step | None, args: argparse.Namespace) -> tuple[float, float]:
    """Time --steps steps after waiting for quiet; retry while other processes intrude."""
    for _ in range(args.retries + 1):
        _wait_for_quiet(args)
        seconds, load, _ = _timed(step, args.steps)
        if not load > args.quiet_cores:
            break
    return seconds, load


def _bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    state = ParallelState.build(1, PP)
    steps = _build_steps(args, state)
    first_losses = {}
    for name in VARIANTS:  # the first step of each: same weights, same batch, same loss
        first_losses[name] = _timed(steps[name], 1)[2]
        if args.warmup > 1:
            _timed(steps[name], args.warmup - 1)
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        shift = r % len(VARIANTS)
        order = VARIANTS[shift:] + VARIANTS[:shift]
        for name in order if r % 2 == 0 else reversed(order):
            rounds[name].append(_clean_timed(steps[name], args))
    return {"first_losses": first_losses, "rounds": rounds, "traces": _traces(steps, args)}


def _traces(steps: dict[str, Step | None], args: argparse.Namespace) -> dict[str, list]:
    """Per megapipe variant, DIAGNOSED_STEPS traced steps, each as every rank's trace events
    (gathered, in rank order)."""
    out: dict[str, list] = {}
    for name in VARIANTS:
        if not name.startswith("megapipe-"):
            continue
        for _ in range(DIAGNOSED_STEPS):
            _wait_for_quiet(args)
            recorder = TraceRecorder(dist.get_rank())
            dist.barrier()
            steps[name](trace=recorder)
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, recorder.events)
            out.setdefault(name, []).append(gathered)
    return out


def diagnose(args: argparse.Namespace, name: str, traced: list) -> dict:
    """The traced steps' span against the replay of their computes through the schedule with
    free transfers (`timeline.replayed_makespan`; medians over the traced steps)."""
    kind_key, mode = variant_kind(name)
    kind, v = KINDS[kind_key]
    spans, replays = [], []
    for events_per_rank in traced:
        boxes = tuple(boxes_from_trace(chrome_trace(events_per_rank)))
        timeline = Timeline(boxes, PP, args.microbatches, v, name, "ms")
        # free transfers: the replay depends on the computes' order only, the same in every mode
        replayed = replayed_makespan(timeline, kind, post_ahead=mode != "")
        if replayed is None:
            raise SystemExit(f"error: the traced step of {name} is not its schedule's computes")
        spans.append(timeline.makespan)
        replays.append(replayed)
    span, replayed = statistics.median(spans), statistics.median(replays)
    return {"traced_ms": span, "replay_ms": replayed, "traced_over_replay": span / replayed}


def _median_clean(samples: list[tuple[float, float]], quiet: float) -> tuple[float, int]:
    """Median seconds over the rounds other processes left quiet (all rounds if under 3)."""
    clean = [t for t, load in samples if not load > quiet]
    return statistics.median(clean if len(clean) >= 3 else [t for t, _ in samples]), len(clean)


def summarize(args: argparse.Namespace, per_rank: list[dict]) -> dict:
    """Medians, ratios, efficiencies and bounds, from the ranks' results."""
    rounds = per_rank[0]["rounds"]  # identical on every rank (all-reduced / broadcast)
    median, clean = {}, {}
    for name, samples in rounds.items():
        median[name], clean[name] = _median_clean(samples, args.quiet_cores)
    m, single = args.microbatches, median["single"]
    rows = {}
    for name in PIPELINES:
        kind, v = KINDS[variant_kind(name)[0]]
        bound = theoretical_efficiency(PP, v, m, kind)
        efficiency = single / (PP * median[name])
        rows[name] = {
            "step_ms": median[name] * 1e3,
            "efficiency": efficiency,
            "bound": bound,
            "of_bound": efficiency / bound,
            "efficiency_vs_single_x2": median["single-x2"] / (PP * median[name]),
            "of_bound_vs_single_x2": median["single-x2"] / (PP * median[name]) / bound,
            "clean_rounds": clean[name],
        }
        if name in per_rank[0]["traces"]:
            rows[name]["diagnosis"] = diagnose(args, name, per_rank[0]["traces"][name])
    for name in PIPELINES:
        if name.startswith("megapipe-"):
            theirs = "torch-" + variant_kind(name)[0]
            rows[name]["ratio_to_torch"] = median[name] / median[theirs]
            rows[name]["ratio_to_torch_1f1b"] = median[name] / median["torch-1f1b"]
    return {
        "single_ms": single * 1e3,
        "single_x2_ms": median["single-x2"] * 1e3,
        "machine_scaling": single / median["single-x2"],
        "clean_rounds": clean,
        "variants": rows,
        "first_step_losses": {  # single-x2 reuses single's model, one step further on
            name: next(r["first_losses"][name] for r in per_rank if r["first_losses"][name])
            for name in VARIANTS
            if name != "single-x2"
        },
        "rounds_ms": {n: [round(t * 1e3, 2) for t, _ in s] for n, s in rounds.items()},
        "foreign_load_cores": {n: [round(load, 3) for _, load in s] for n, s in rounds.items()},
    }


def print_table(args: argparse.Namespace, summary: dict) -> None:
    clean = summary["clean_rounds"]
    print(
        f"single process (all {args.layers} layers): {summary['single_ms']:.1f} ms per step; "
        f"two at once: {summary['single_x2_ms']:.1f} ms (machine scaling "
        f"{summary['machine_scaling']:.3f}; 1.0 = two cores as fast as one)"
    )
    print(
        f"{'variant':<34}{'step ms':>9}{'vs torch':>10}{'efficiency':>12}{'bound':>8}"
        f"{'of bound':>10}{'eff. vs x2':>12}{'x2 of bound':>13}{'clean':>7}"
    )
    for name, row in summary["variants"].items():
        ratio = f"{row['ratio_to_torch']:.3f}" if "ratio_to_torch" in row else "-"
        print(
            f"{name:<34}{row['step_ms']:>9.1f}{ratio:>10}{row['efficiency']:>12.3f}"
            f"{row['bound']:>8.3f}{row['of_bound']:>10.1%}{row['efficiency_vs_single_x2']:>12.3f}"
            f"{row['of_bound_vs_single_x2']:>13.1%}{row['clean_rounds']:>4}/{args.rounds}"
        )
    print(f"clean rounds of single / single-x2: {clean['single']}, {clean['single-x2']}")
    print(
        f"diagnosis ({DIAGNOSED_STEPS} traced steps each; replay: the simulator with the traced "
        "compute durations and free transfers)"
    )
    print(f"{'variant':<34}{'traced ms':>11}{'replay ms':>11}{'traced/replay':>15}")
    for name, row in summary["variants"].items():
        if "diagnosis" in row:
            d = row["diagnosis"]
            print(
                f"{name:<34}{d['traced_ms']:>11.1f}{d['replay_ms']:>11.1f}"
                f"{d['traced_over_replay']:>15.3f}"
            )
    to_1f1b = {
        n: r["ratio_to_torch_1f1b"]
        for n, r in summary["variants"].items()
        if KINDS[variant_kind(n)[0]][0] in ZERO_BUBBLE_KINDS and "ratio_to_torch_1f1b" in r
    }
    print(
        "zero-bubble step over torch's 1F1B step: "
        + ", ".join(f"{n} {r:.3f}" for n, r in to_1f1b.items())
    )
    losses = summary["first_step_losses"]
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="a multiple of 4 (PP=2 x v=2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="m")
    p.add_argument("--vocab", type=int, default=512, help="a multiple of 128 (no padding)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (order rotates)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.15,
        help="a round is clean if other processes kept at most this many cores busy",
    )
    p.add_argument("--max-wait", type=float, default=10.0, help="s to wait for quiet, per try")
    p.add_argument("--retries", type=int, default=2, help="re-timings of a disturbed measurement")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    p.add_argument("--quick", action="store_true", help="1 warm-up step, 2 rounds of 1 step")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds, args.steps = 1, 2, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.optim.Adam([torch.zeros(1)])  # imports torch._dynamo once, before forking
    started = time.monotonic()
    per_rank = run_distributed(_bench_rank, PP, args, timeout=1800)
    summary = summarize(args, per_rank)
    print(
        f"megapipe pipeline benchmark: torch {torch.__version__}, PP={PP}, 1 thread per rank, "
        f"{platform.machine()} ({os.cpu_count()} cpus), {time.monotonic() - started:.0f} s"
    )
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab}, m={args.microbatches} micro-batches of {args.micro_batch}; "
        f"{args.warmup} warm-up steps, {args.rounds} rounds x {args.steps} steps"
    )
    print_table(args, summary)
    losses = list(summary["first_step_losses"].values())
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise SystemExit(
            "error: the variants' first-step losses differ; they are not the same model"
        )
    result = {
        "benchmark": "pipeline",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        **summary,
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
