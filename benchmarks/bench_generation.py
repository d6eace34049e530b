"""Generation speed with and without the KV cache, side by side: tokens per second of
`megapipe.inference.generation.generate` for a small GPT at a few batch sizes and lengths.

With the cache, a run prefills the prompt once and then runs one position per step; without
it, every step runs the whole prefix again (`use_cache=False`, the reference the cache is
tested against). The model is random-initialised in memory at each layout (megapipe's
initialisation is layout-invariant, so TP=2 runs the same weights as one rank): loading a
checkpoint changes nothing about the speed of a step. Greedy, no EOD, so every sequence gets
exactly --new tokens and both modes do the same amount of output.

Each (layout, batch, new) cell runs the two modes in alternating order for --repeats rounds
after one warm-up each; the tables give the median. One rank uses --threads threads; TP=2 runs
two forked gloo ranks with one thread each (megapipe.testing), timed on rank 0.

    python benchmarks/bench_generation.py           # ~2 minutes on 2 CPU cores
    python benchmarks/bench_generation.py --quick   # ~15 s smoke test; numbers not meaningful
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megapipe.atomic_files import write_json
from megapipe.config import ModelConfig
from megapipe.conversion.convert import check_target
from megapipe.inference.generation import generate
from megapipe.inference.loading import InferenceModel
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

DEFAULT_JSON = "benchmarks/out/generation.json"
MODES = ("cached", "uncached")


def model_config(args: argparse.Namespace) -> ModelConfig:
    context = args.prompt + max(args.new)
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, vocab_size=args.vocab,
                       seq_length=context, attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip


def build(config: ModelConfig, state: ParallelState, seed: int) -> InferenceModel:
    """This rank's stage of a random-initialised model, ready for generate()."""
    stages = check_target(config, state.tp.size, state.pp.size)
    rng = RNGTracker(seed, state.tp_rank, state.pp_rank, state.device)
    model = GPTModel(config, state, rng, seed=seed, layers=stages[state.pp.rank])
    model.eval()
    return InferenceModel(config, state, model, {}, "random init", torch.float32)


def prompts(config: ModelConfig, batch: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator).tolist()


def _machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has run so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _timed(state: ParallelState, run: Callable[[], object] | None) -> tuple[float, float]:
    """(wall seconds of `run` on the slowest rank, CPU cores other processes kept busy
    meanwhile), the same on every rank; run None: a 0.3 s sample of the others' load."""
    if state.world_size > 1:
        dist.barrier(group=state.world.pg)
    busy, cpu, start = _machine_busy_s(), time.process_time(), time.perf_counter()
    if run is None:
        time.sleep(0.3)
    else:
        run()
    ours = torch.tensor([time.perf_counter() - start, time.process_time() - cpu],
                        dtype=torch.float64)  # fmt: skip
    if state.world_size > 1:
        dist.all_reduce(ours[:1], op=dist.ReduceOp.MAX, group=state.world.pg)
        dist.all_reduce(ours[1:], op=dist.ReduceOp.SUM, group=state.world.pg)
    after = _machine_busy_s()
    wall = float(ours[0])
    foreign = torch.tensor([float("nan") if busy is None or after is None
                            else (after - busy - float(ours[1])) / wall])  # fmt: skip
    if state.world_size > 1:  # rank 0's view decides, so every rank retries alike
        dist.broadcast(foreign, src=state.world.ranks[0], group=state.world.pg)
    return wall, float(foreign)


def _clean_run(state: ParallelState, run: Callable[[], object], args) -> tuple[float, float]:
    """Wait (up to --max-wait s) until other processes use under --quiet-cores, then time
    `run`; once more (--retries) if they intruded meanwhile."""
    for _ in range(args.retries + 1):
        deadline = time.monotonic() + args.max_wait
        while time.monotonic() < deadline and _timed(state, None)[1] > args.quiet_cores:
            time.sleep(0.5)
        wall, foreign = _timed(state, run)
        if not foreign > args.quiet_cores:  # NaN (cannot tell) counts as quiet
            break
    return wall, foreign


def measure(m: InferenceModel, args: argparse.Namespace) -> list[dict]:
    """Every (batch, new) cell on this layout: (seconds, others' load) per run of each mode
    (collective)."""
    cells = []
    for batch in args.batch:
        for new in args.new:
            ids = prompts(m.config, batch, args.prompt, args.seed + batch)
            tokens, runs = {}, {mode: [] for mode in MODES}
            for mode in MODES:  # warm-up (and the tokens each mode writes)
                results = generate(m, ids, new, use_cache=mode == "cached")
                tokens[mode] = [r.tokens for r in results]
            for r in range(args.repeats):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    run = functools.partial(generate, m, ids, new, use_cache=mode == "cached")
                    runs[mode].append(_clean_run(m.state, run, args))
            same = sum(a == b for a, b in zip(tokens["cached"], tokens["uncached"]))
            cells.append({"batch": batch, "new": new, "runs": runs, "same_sequences": same})
    return cells


def _clean_seconds(runs: list[tuple[float, float]], quiet: float) -> tuple[list[float], int]:
    """The runs other processes left quiet (all of them when none was)."""
    clean = [wall for wall, load in runs if not load > quiet]
    return clean or [wall for wall, _ in runs], len(clean)


def _on_rank(rank: int, world: int, config: ModelConfig, args: argparse.Namespace) -> list[dict]:
    state = ParallelState.build(world, 1)
    return measure(build(config, state, args.seed), args)


def summarise(layout: str, threads: str, cells: list[dict], quiet: float) -> list[dict]:
    rows = []
    for cell in cells:
        generated = cell["batch"] * cell["new"]
        seconds, clean = {}, {}
        for mode in MODES:
            seconds[mode], clean[mode] = _clean_seconds(cell["runs"][mode], quiet)
        median = {mode: statistics.median(seconds[mode]) for mode in MODES}
        rate = {mode: generated / median[mode] for mode in MODES}
        best = {mode: generated / min(seconds[mode]) for mode in MODES}  # noise only adds time
        rows.append({
            "layout": layout, "threads_per_rank": threads, "batch": cell["batch"],
            "new_tokens": cell["new"], "cached_tokens_per_s": rate["cached"],
            "uncached_tokens_per_s": rate["uncached"],
            "ratio_cached_over_uncached": rate["cached"] / rate["uncached"],
            "best_ratio": best["cached"] / best["uncached"],
            "cached_ms_per_step": median["cached"] / cell["new"] * 1e3,
            "uncached_ms_per_step": median["uncached"] / cell["new"] * 1e3,
            "same_sequences": f"{cell['same_sequences']}/{cell['batch']}",
            "quiet_runs": {mode: clean[mode] for mode in MODES},
            "runs_seconds_and_other_load": cell["runs"],
        })  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'layout':>7} {'batch':>5} {'new':>4} {'cached tok/s':>12} {'uncached tok/s':>14} "
          f"{'ratio':>6} {'best':>5} {'cached ms/step':>14} {'uncached ms/step':>16} "
          f"{'same':>5}")  # fmt: skip
    for r in rows:
        print(f"{r['layout']:>7} {r['batch']:>5} {r['new_tokens']:>4} "
              f"{r['cached_tokens_per_s']:>12.1f} {r['uncached_tokens_per_s']:>14.1f} "
              f"{r['ratio_cached_over_uncached']:>6.2f} {r['best_ratio']:>5.2f} "
              f"{r['cached_ms_per_step']:>14.2f} "
              f"{r['uncached_ms_per_step']:>16.2f} {r['same_sequences']:>5}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, nargs="+", default=[32, 128], help="new tokens per run")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="prompts per run")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="layouts to run")
    p.add_argument("--threads", type=int, default=2, help="torch threads at one rank")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode per cell")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.5,
        help="other processes' CPU use (cores) above which a run is disturbed",
    )
    p.add_argument("--max-wait", type=float, default=20.0, help="s to wait for quiet per try")
    p.add_argument("--retries", type=int, default=1, help="reruns of a disturbed run")
    p.add_argument("--json", default=DEFAULT_JSON, help="'' to skip writing")
    p.add_argument(
        "--quick", action="store_true", help="one repeat, 8 and 32 new tokens, 2 s waits"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.new, args.max_wait = 1, [8, 32], 2.0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config = model_config(args)
    load_before = os.getloadavg()[0]  # other processes skew these timings: recorded
    rows = []
    for tp in args.tp:
        if tp == 1:
            torch.set_num_threads(args.threads)
            cells = measure(build(config, ParallelState.single(), args.seed), args)
            rows += summarise("1 rank", str(args.threads), cells, args.quiet_cores)
        else:
            per_rank = run_distributed(_on_rank, tp, config, args, timeout=1800)
            rows += summarise(
                f"TP={tp}", "1", per_rank[0], args.quiet_cores
            )  # rank 0 waits for the others
    params = sum(
        p.numel() for p in build(config, ParallelState.single(), args.seed).model.parameters()
    )
    print(f"generation benchmark: torch {torch.__version__}, {platform.machine()} "
          f"({os.cpu_count()} cpus); model {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, vocab {args.vocab}, {params:,} params; prompt {args.prompt} "
          f"tokens, greedy; median of {args.repeats} runs per mode; 1-minute load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")  # fmt: skip
    print_table(rows)
    print("\nratio: cached / uncached tokens per second (medians); best: the same from each "
          "mode's fastest run; ms/step: median run / new tokens; same: sequences both modes "
          f"wrote alike. Runs disturbed by other processes (> {args.quiet_cores} cores) are "
          "left out where quiet ones exist (counts in the JSON).")  # fmt: skip
    report = {
        "benchmark": "generation",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "params": params,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
    }
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
