"""Activation memory: saved bytes per layer (measured against the formula) for each mode, the
step-time cost of recomputation, and the per-stage memory of GPT-3 1.3B before and after
--pipeline-partition memory.

1. One transformer layer's saved-for-backward bytes (saved_tensors_hooks, parameters excluded)
   at 1 rank, TP2 and TP2+SP (forked gloo ranks), without recomputation, with selective
   (core_attn, mlp, both) and with full recomputation, next to
   `megapipe/model/activation_memory.layer_activation_bytes` and in units of sbh.
2. Forward + backward time of a small GPT at 1 rank with each recomputation mode, in
   alternating rounds; the median ratio to no recomputation.
3. `pipeline/stage_memory` tables for GPT-3 1.3B (bf16, Adam, micro-batch 1, 32 micro-batches)
   at PP=4 and PP=8: uniform against the memory partition.

    python benchmarks/bench_activation_memory.py           # ~1 min on 2 cores
    python benchmarks/bench_activation_memory.py --quick   # ~15 s
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from megapipe.atomic_files import write_json
from megapipe.config import ModelConfig, OptimizerConfig, ParallelConfig, RecomputeConfig
from megapipe.model.activation_memory import layer_activation_bytes, saved_activation_bytes
from megapipe.model.gpt import GPTModel
from megapipe.model.recompute import recompute
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.mappings import split_along
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.stage_memory import MemoryModel, describe, deviation, plan_stages
from megapipe.testing import run_distributed

MODES = {
    "none": RecomputeConfig(),
    "selective core_attn": RecomputeConfig("selective", modules=("core_attn",)),
    "selective mlp": RecomputeConfig("selective", modules=("mlp",)),
    "selective core_attn+mlp": RecomputeConfig("selective", modules=("core_attn", "mlp")),
    "full": RecomputeConfig("full", "uniform", 1),
}


def layer_config(args: argparse.Namespace, dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        vocab_size=args.vocab, seq_length=args.seq, max_position_embeddings=args.seq,
        attention_dropout=dropout, hidden_dropout=dropout,
    )  # fmt: skip


def _saved_table(rank: int, world: int, config: ModelConfig, b: int, sp: bool) -> dict:
    state = ParallelState.build(world, 1) if world > 1 else ParallelState.single()
    table = {}
    for name, mode in MODES.items():
        layer = TransformerLayer(config, state.tp, RNGTracker(1, state.tp_rank),
                                 sequence_parallel=sp, recompute=mode).train()  # fmt: skip
        x = torch.randn(config.seq_length, b, config.hidden_size)
        x = (split_along(x, 0, state.tp) if sp else x).clone().requires_grad_(True)

        def forward(layer=layer, x=x, mode=mode):
            return recompute(layer, x, rng=layer.rng) if mode.full else layer(x)

        measured = saved_activation_bytes(forward, layer.parameters())
        formula = layer_activation_bytes(config, b, world, sequence_parallel=sp, recompute=mode)
        table[name] = {"measured": measured, "formula": formula}
    return table


def saved_bytes(args: argparse.Namespace) -> dict:
    config = layer_config(args)
    b = args.micro_batch
    return {
        "1 rank": _saved_table(0, 1, config, b, False),
        "TP2": run_distributed(_saved_table, 2, config, b, False)[0],
        "TP2+SP": run_distributed(_saved_table, 2, config, b, True)[0],
    }


def step_times(args: argparse.Namespace) -> dict:
    config = layer_config(args, dropout=0.1)
    torch.manual_seed(0)
    tokens = torch.randint(args.vocab, (args.micro_batch, args.seq))
    models = {name: GPTModel(config, ParallelState.single(), RNGTracker(1), seed=1,
                             recompute=mode).train() for name, mode in MODES.items()}  # fmt: skip

    def step(model: GPTModel) -> float:
        start = time.perf_counter()
        model(tokens=tokens, labels=tokens).mean().backward()
        return time.perf_counter() - start

    for model in models.values():
        step(model)  # warm-up
    rounds: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rounds[name].append(step(models[name]))
    base = statistics.median(rounds["none"])
    return {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / base}
            for name, t in rounds.items()}  # fmt: skip


def stage_tables() -> dict:
    gpt3 = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                       vocab_size=50257, seq_length=2048, max_position_embeddings=2048,
                       attention_dropout=0.0)  # fmt: skip
    out = {}
    for p in (4, 8):
        model = MemoryModel(gpt3, ParallelConfig(pipeline_model_parallel_size=p),
                            OptimizerConfig(bf16=True), RecomputeConfig(), 1, 32, 1)  # fmt: skip
        for method in ("uniform", "memory"):
            parallel = ParallelConfig(pipeline_model_parallel_size=p, pipeline_partition=method)
            stage_map = plan_stages(gpt3, parallel, micro_batch_size=1, num_microbatches=32,
                                    optimizer=OptimizerConfig(bf16=True),
                                    recompute=RecomputeConfig(), data_parallel_size=1)  # fmt: skip
            stages = model.stages(stage_map)
            print(f"\nGPT-3 1.3B, PP={p}, --pipeline-partition {method}")
            print(stage_map.describe())
            print(describe(stages))
            out[f"PP{p} {method}"] = {"layers": [s.layers for s in stages],
                                      "recompute": [r.describe() for r in stage_map.recompute],
                                      "total_MiB": [s.total_bytes / 2**20 for s in stages],
                                      "deviation": deviation(stages)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/out/activation_memory.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 4
    torch.set_num_threads(args.threads)

    saved = saved_bytes(args)
    sbh = args.seq * args.micro_batch * args.hidden * 4
    print(f"saved bytes per layer (s={args.seq}, b={args.micro_batch}, h={args.hidden}, "
          f"a={args.heads}, fp32, no dropout; sbh = {sbh} bytes)")  # fmt: skip
    print(f"{'layout':8} {'mode':26} {'measured':>10} {'formula':>10} {'x sbh':>7}")
    for layout, table in saved.items():
        for name, row in table.items():
            print(f"{layout:8} {name:26} {row['measured']:10d} {row['formula']:10d} "
                  f"{row['measured'] / sbh:7.2f}")  # fmt: skip
    times = step_times(args)
    print(f"\nforward + backward at 1 rank, dropout 0.1, {args.rounds} alternating rounds")
    print(f"{'mode':26} {'median ms':>10} {'ratio':>7}")
    for name, row in times.items():
        print(f"{name:26} {row['median_s'] * 1e3:10.1f} {row['ratio']:7.3f}")
    stages = stage_tables()
    if args.json:
        write_json(args.json, {
            "benchmark": "activation_memory", "args": vars(args),
            "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": platform.machine(), "saved_bytes": saved, "step_times": times,
            "stages": stages,
        })  # fmt: skip


if __name__ == "__main__":
    main()
