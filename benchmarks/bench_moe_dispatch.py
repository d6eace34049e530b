"""Expert parallelism's token dispatchers on this CPU: one MoE layer's forward + backward on two
gloo ranks (one thread each), side by side in one run:

* `EP1`: every rank holds all experts and runs its own tokens (no token exchange): the scale;
* `EP2 alltoall`: each rank holds half the experts; rows go to their expert's rank and back
  by all-to-all (--moe-token-dispatcher-type alltoall);
* `EP2 allgather`: the same experts; every rank gathers both ranks' tokens, runs its experts'
  share and a reduce-scatter returns the outputs (--moe-token-dispatcher-type allgather);
* `EP2 alltoall grouped`: alltoall with --moe-grouped-gemm.

Before timing, each EP2 variant's output and input gradient are checked against EP1's on the
same tokens. Variants rotate over rounds; a round's time is the median of its steps (the
slower rank's); each ratio is the median over rounds of the per-round ratio to `EP1`.

    python benchmarks/bench_moe_dispatch.py           # ~1 minute on 2 cores
    python benchmarks/bench_moe_dispatch.py --quick   # smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import run_record  # noqa: E402

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.config import ModelConfig, MoEConfig  # noqa: E402
from megapipe.model.initialization import initialize_parameters  # noqa: E402
from megapipe.model.moe import MoELayer  # noqa: E402
from megapipe.parallel.state import Group, ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "moe_dispatch.json")
VARIANTS = ("EP1", "EP2 alltoall", "EP2 allgather", "EP2 alltoall grouped")


def _layer(args: argparse.Namespace, variant: str, ep: Group) -> MoELayer:
    dispatcher = "allgather" if "allgather" in variant else "alltoall"
    moe = MoEConfig(
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm="grouped" in variant,
    )
    config = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                         vocab_size=128, seq_length=args.seq, ffn_hidden_size=args.ffn,
                         add_bias_linear=False, init_method_std=0.05, moe=moe)  # fmt: skip
    group = ep if variant != "EP1" else Group.single(ep.rank)
    layer = MoELayer(config, Group.single(), output_init_std=0.05, ep=group)
    initialize_parameters(layer, 7, 0, 1, group.rank, group.size)  # the same global weights
    return layer


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    ep = ParallelState.build(expert_model_parallel_size=2).ep
    layers = {v: _layer(args, v, ep) for v in VARIANTS}
    x = torch.randn(
        args.seq, args.batch, args.hidden, generator=torch.Generator().manual_seed(rank)
    )
    upstream = torch.randn_like(x)

    def run(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        xi = x.clone().requires_grad_(True)
        out = layers[variant](xi)[0]
        (out * upstream).sum().backward()
        return out.detach(), xi.grad

    reference = run("EP1")
    checks = {}
    for variant in VARIANTS[1:]:
        out, grad = run(variant)
        checks[variant] = max((out - reference[0]).abs().max().item(),
                              (grad - reference[1]).abs().max().item())  # fmt: skip
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % 4 :] + VARIANTS[: r % 4]:
            steps = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                run(variant)
                elapsed = torch.tensor((time.perf_counter() - start) * 1e3)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's step
                steps.append(float(elapsed))
            times[variant].append(statistics.median(steps))
    return {"times": times, "checks": checks}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.rounds, args.steps = 128, 2, 1
    ranks = run_distributed(_rank, 2, args, timeout=1800.0)
    for variant in ranks[0]["checks"]:
        worst = max(r["checks"][variant] for r in ranks)
        print(f"{variant} vs EP1: max abs difference {worst:.1e}")
        if not worst <= 1e-4:  # NaN too
            raise SystemExit(f"{variant} differs from EP1 by {worst:.1e}")
    times = ranks[0]["times"]  # the same (max over ranks) on both
    summary = {
        v: {"median_ms": statistics.median(t),
            "ratio_to_ep1": statistics.median(a / b for a, b in zip(t, times["EP1"]))}
        for v, t in times.items()
    }  # fmt: skip
    print(f"\nMoE forward + backward on 2 gloo ranks: {args.seq} x {args.batch} tokens a rank, "
          f"hidden {args.hidden}, {args.experts} experts of ffn {args.ffn}, top-{args.topk}, "
          "fp32, 1 thread a rank")  # fmt: skip
    print(f"{'variant':22} {'median ms':>10} {'vs EP1':>8}")
    for v, row in summary.items():
        print(f"{v:22} {row['median_ms']:10.1f} {row['ratio_to_ep1']:8.3f}")
    result = {"summary": summary, **run_record("moe_dispatch", args)}
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
