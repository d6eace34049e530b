"""The MoE layer's forward + backward on this CPU, side by side in one process (1 thread):

* `megapipe`: `megapipe.model.moe.MoELayer` (router, dispatch plan, experts one GEMM pair each,
  weighted combine), the experts as a loop;
* `megapipe-grouped`: the same with `--moe-grouped-gemm` (torch.nn.functional.grouped_mm where
  the strides fit);
* `plain`: the same math written here in plain PyTorch (softmax top-k, `index_select` per
  expert, `F.linear` / GeLU / `F.linear`, `index_add_` back), the weights shared with the layer;
* `dense`: the dense MLP of the same active FLOPs (ffn x top-k), for scale.

Variants rotate over rounds; a round's time is the median of its steps; each ratio is the
median over rounds of the per-round ratio to `plain`. Before timing, megapipe's output and
gradients are checked against `plain`'s (fp32).

    python benchmarks/bench_moe.py           # ~1 minute on 2 cores
    python benchmarks/bench_moe.py --quick   # smoke test (ratios not meaningful)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import run_record  # noqa: E402

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.config import ModelConfig, MoEConfig  # noqa: E402
from megapipe.model.mlp import MLP  # noqa: E402
from megapipe.model.moe import MoELayer  # noqa: E402
from megapipe.parallel.state import Group  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "moe.json")


def plain_moe(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              k: int) -> torch.Tensor:  # fmt: skip
    """Top-k of the logits, softmax over the chosen, each expert a GeLU MLP on its tokens."""
    s, b, h = x.shape
    tokens = x.reshape(s * b, h)
    logits = F.linear(tokens, router)
    top, chosen = logits.topk(k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(tokens)
    for e in range(w1.shape[0]):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        y = F.linear(F.gelu(F.linear(tokens.index_select(0, rows), w1[e])), w2[e])
        out = out.index_add(0, rows, y * weights[rows, slot].unsqueeze(-1))
    return out.view(s, b, h)


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
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=args.experts, moe_router_topk=args.topk)
    base = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                       vocab_size=128, seq_length=args.seq, ffn_hidden_size=args.ffn,
                       add_bias_linear=False, moe=moe)  # fmt: skip
    loop = MoELayer(base, Group.single(), output_init_std=0.02)
    with torch.no_grad():  # a layer alone is not initialised (GPTModel initialises its own)
        for param in loop.parameters():
            param.normal_(0.0, 0.05)
    grouped_moe = dataclasses.replace(moe, moe_grouped_gemm=True)
    grouped_config = dataclasses.replace(base, moe=grouped_moe)
    grouped = MoELayer(grouped_config, Group.single(), output_init_std=0.02)
    grouped.load_state_dict(loop.state_dict())
    dense = MLP(dataclasses.replace(base, moe=None, ffn_hidden_size=args.ffn * args.topk),
                Group.single(), output_init_std=0.02, sequence_parallel=False)  # fmt: skip
    with torch.no_grad():
        for param in dense.parameters():
            param.normal_(0.0, 0.05)
    x = torch.randn(args.seq, args.batch, args.hidden)
    upstream = torch.randn_like(x)
    weights = [loop.router.weight, loop.experts.weight1, loop.experts.weight2]

    def run(name: str):
        xi = x.clone().requires_grad_(True)
        if name == "plain":
            out = plain_moe(xi, *weights, args.topk)
        elif name == "dense":
            out = dense(xi)[0]
        else:
            out = (loop if name == "megapipe" else grouped)(xi)[0]
        (out * upstream).sum().backward()
        return out.detach(), xi.grad

    ref_out, ref_grad = run("plain")
    for name in ("megapipe", "megapipe-grouped"):
        out, grad = run(name)
        diff = max((out - ref_out).abs().max().item(), (grad - ref_grad).abs().max().item())
        print(f"{name} vs plain: max abs difference {diff:.1e}")
        if not diff <= 1e-4:  # NaN too
            raise SystemExit(f"{name} differs from the plain MoE by {diff:.1e}")
    names = ["plain", "megapipe", "megapipe-grouped", "dense"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 4 :] + names[: r % 4]:
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                run(name)
                steps.append((time.perf_counter() - start) * 1e3)
            times[name].append(statistics.median(steps))
    summary = {
        n: {"median_ms": statistics.median(t),
            "ratio_to_plain": statistics.median(a / b for a, b in zip(t, times["plain"]))}
        for n, t in times.items()
    }  # fmt: skip
    print(f"\nMoE forward + backward: {args.seq} x {args.batch} tokens, hidden {args.hidden}, "
          f"{args.experts} experts of ffn {args.ffn}, top-{args.topk}, fp32, 1 thread")  # fmt: skip
    print(f"{'variant':18} {'median ms':>10} {'vs plain':>9}")
    for n, row in summary.items():
        print(f"{n:18} {row['median_ms']:10.1f} {row['ratio_to_plain']:9.3f}")
    result = {"summary": summary, **run_record("moe", args)}
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
