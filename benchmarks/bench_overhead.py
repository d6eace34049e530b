"""Framework overhead at TP=PP=DP=1: megapipe's GPTModel against a plain-PyTorch GPT.

Both models compute the same math ([s, b, h] activations, learned absolute positions, pre-norm
LayerNorm, fused QKV with bias, causal scaled_dot_product_attention, GeLU MLP of 4h, residuals,
final LayerNorm, output layer tied to the word embedding, cross-entropy) with the same size, the
same weights (the plain model, `megapipe/testing/reference_gpt.py`, is loaded from megapipe's
initialisation), the same inputs and the same thread count. One timed step is forward +
backward + Adam step + zero_grad.

After a warm-up the two are timed in alternating rounds (AB, BA, AB, ...; each round times
`--steps` steps of each), so slow drifts of a noisy machine hit both alike. The headline number
is the median over rounds of the per-round ratio megapipe / plain.

    python benchmarks/bench_overhead.py            # full run: 1-2 minutes on 2 cores
    python benchmarks/bench_overhead.py --quick    # ~15 s smoke test (ratio not meaningful)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from round_args import add_round_args, parse_round_args
from torch import nn

from megapipe.atomic_files import write_json
from megapipe.testing.reference_gpt import PlainGPT, copy_weights

# --------------------------------------------------------------------------------------------
# Building both models from one configuration.
# --------------------------------------------------------------------------------------------


def build_megapipe(args: argparse.Namespace) -> nn.Module:
    from megapipe.arguments.validation import validate_model
    from megapipe.config import ModelConfig
    from megapipe.model.gpt import GPTModel
    from megapipe.parallel.random import RNGTracker
    from megapipe.parallel.state import ParallelState

    config = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        attention_dropout=args.dropout,
        hidden_dropout=args.dropout,
    )
    validate_model(config)
    if config.padded_vocab_size(1) != args.vocab:
        raise SystemExit(f"--vocab {args.vocab} must be a multiple of 128 (no padding)")
    rng = RNGTracker(args.seed)
    rng.seed_default()
    return GPTModel(config, ParallelState.single(), rng, seed=args.seed)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------

Step = Callable[[], float]
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "overhead.json")


def make_step(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float):
    """One training step per call on the next batch; returns the loss as a float."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    state = {"i": 0}
    is_plain = isinstance(model, PlainGPT)

    def step() -> float:
        tokens, labels = batches[state["i"] % len(batches)]
        first = state["i"] * tokens.shape[0]
        state["i"] += 1
        if is_plain:
            loss = model(tokens, labels)
        else:  # global sample ids, as pretrain_gpt.py passes them: layout-invariant dropout
            sample_ids = torch.arange(first, first + tokens.shape[0])
            loss = model(tokens=tokens, labels=labels, sample_ids=sample_ids)
        loss = loss.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def time_steps(step: Step, n: int) -> list[float]:
    """Seconds taken by each of n steps."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096, help="a multiple of 128 (no padding)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention and hidden, both models")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    add_round_args(p, warmup=5, rounds=40, steps=2, default_json=DEFAULT_JSON)
    return parse_round_args(p, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    megapipe_model = build_megapipe(args)
    plain_model = PlainGPT(args.layers, args.hidden, args.heads, args.vocab, args.seq, args.dropout)
    copy_weights(megapipe_model, plain_model)
    n_megapipe, n_plain = count_params(megapipe_model), count_params(plain_model)
    if n_megapipe != n_plain:
        raise SystemExit(f"parameter counts differ: megapipe {n_megapipe} vs plain {n_plain}")

    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(4):
        seq = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))

    steps = {
        "megapipe": make_step(megapipe_model, batches, args.lr),
        "plain": make_step(plain_model, batches, args.lr),
    }
    # Step 0 (also the first warm-up step): same weights and inputs, so the same loss, and both
    # near ln(vocab) for a freshly initialised model.
    loss0 = {name: step() for name, step in steps.items()}
    ln_vocab = math.log(args.vocab)
    for name, loss in loss0.items():
        if abs(loss - ln_vocab) > 0.05 * ln_vocab:
            raise SystemExit(f"{name} step-0 loss {loss:.4f} is far from ln(vocab) {ln_vocab:.4f}")
    loss_gap = abs(loss0["megapipe"] - loss0["plain"])
    if args.dropout == 0.0 and loss_gap > 1e-4:
        raise SystemExit(f"step-0 losses differ by {loss_gap:.2e}: the models' math differs")
    for step in steps.values():
        for _ in range(args.warmup - 1):
            step()

    rounds = []
    order = ["megapipe", "plain"]
    for r in range(args.rounds):
        step_ms = {}
        for name in order if r % 2 == 0 else order[::-1]:
            step_ms[name] = [t * 1e3 for t in time_steps(steps[name], args.steps)]
        # A round's time is the median of its steps: one step hit by a noisy neighbour does
        # not move it.
        mp, pl = statistics.median(step_ms["megapipe"]), statistics.median(step_ms["plain"])
        rounds.append(
            {
                "round": r,
                "first": order[r % 2],
                "megapipe_ms": mp,
                "plain_ms": pl,
                "ratio": mp / pl,
                "megapipe_step_ms": step_ms["megapipe"],
                "plain_step_ms": step_ms["plain"],
            }
        )

    med_megapipe = statistics.median(x["megapipe_ms"] for x in rounds)
    med_plain = statistics.median(x["plain_ms"] for x in rounds)
    ratios = [x["ratio"] for x in rounds]
    # Noise only ever adds time, so the fastest step of each model is a second, independent
    # estimate (timeit's rule).
    best = {n: min(t for x in rounds for t in x[f"{n}_step_ms"]) for n in ("megapipe", "plain")}
    med_ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med_ratio,) * 3

    print(
        f"megapipe overhead benchmark: torch {torch.__version__}, {args.threads} threads, "
        f"{platform.machine()} ({os.cpu_count()} cpus)"
    )
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"micro-batch {args.micro_batch}, vocab {args.vocab}, dropout {args.dropout}, "
        f"{n_megapipe:,} params (both)"
    )
    print(
        f"step-0 loss: megapipe {loss0['megapipe']:.6f}, plain {loss0['plain']:.6f}, "
        f"ln(vocab) {ln_vocab:.6f}"
    )
    print(f"{args.warmup} warm-up steps each; {args.rounds} rounds x {args.steps} steps each\n")
    print(f"{'round':>5}  {'first':>8}  {'megapipe ms':>11}  {'plain ms':>9}  {'ratio':>6}")
    for x in rounds:
        print(
            f"{x['round']:>5}  {x['first']:>8}  {x['megapipe_ms']:>11.2f}  "
            f"{x['plain_ms']:>9.2f}  {x['ratio']:>6.3f}"
        )
    print(f"{'median':>5}  {'':>8}  {med_megapipe:>11.2f}  {med_plain:>9.2f}  {med_ratio:>6.3f}")
    best_ratio = best["megapipe"] / best["plain"]
    print(
        f"{'best':>5}  {'':>8}  {best['megapipe']:>11.2f}  {best['plain']:>9.2f}  "
        f"{best_ratio:>6.3f}"
    )
    print(
        f"\nmedian per-round ratio megapipe/plain: {med_ratio:.3f} "
        f"(interquartile range {q1:.3f}-{q3:.3f}; target <= 1.03: "
        f"{'met' if med_ratio <= 1.03 else 'NOT met'})"
    )

    result = {
        "benchmark": "overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "params": n_megapipe,
        "step0_loss": {**loss0, "ln_vocab": ln_vocab},
        "rounds": rounds,
        "median_ms": {"megapipe": med_megapipe, "plain": med_plain},
        "median_ratio": med_ratio,
        "ratio_quartiles": [q1, q3],
        "ratio_of_medians": med_megapipe / med_plain,
        "best_step_ms": best,
        "ratio_of_best_steps": best_ratio,
        "target": 1.03,
        "target_met": med_ratio <= 1.03,
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
