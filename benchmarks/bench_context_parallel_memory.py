"""Activation memory per rank under context parallelism, against sequence length.

For S = 2K, 4K, 8K, 16K tokens: one transformer layer's saved-for-backward bytes
(saved_tensors_hooks over its forward, parameters excluded: deterministic, unlike the
allocator's counters) on each rank of a real CP group (forked gloo ranks, one thread each) at
CP 1, 2 and 4 with each comm type, next to `model/activation_memory.layer_activation_bytes`
and to the one-rank bytes divided by CP (what CP promises). fp32, rope, GQA (8 heads, 2 query
groups), micro-batch 1, no dropout. The last column is the rank's bytes per token.

    python benchmarks/bench_context_parallel_memory.py           # ~2-4 min on 2 cores
    python benchmarks/bench_context_parallel_memory.py --quick   # S = 1K, 2K only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import run_record  # noqa: E402

from megapipe.atomic_files import write_json  # noqa: E402
from megapipe.config import ModelConfig  # noqa: E402
from megapipe.model.activation_memory import (  # noqa: E402
    layer_activation_bytes,
    saved_activation_bytes,
)
from megapipe.model.rotary import RotaryEmbedding  # noqa: E402
from megapipe.model.transformer_layer import TransformerLayer  # noqa: E402
from megapipe.parallel.random import RNGTracker  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402

DEFAULT_JSON = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "out", "context_parallel_memory.json"
)
LAYOUTS = [(1, "-"), (2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "p2p"), (4, "all_gather"),
           (4, "a2a")]  # fmt: skip
_MB = 1024.0 * 1024.0


def _config(args: argparse.Namespace, seq: int) -> ModelConfig:
    return ModelConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, vocab_size=128, seq_length=seq,
        max_position_embeddings=seq, attention_dropout=0.0, hidden_dropout=0.0,
        position_embedding_type="rope",
    )  # fmt: skip


def _layer_bytes(rank: int, world: int, args: argparse.Namespace, seq: int, comm: str) -> int:
    """This rank's saved bytes for one layer's forward over its S / CP tokens."""
    torch.manual_seed(rank)
    state = ParallelState.build(1, context_parallel_size=world) if world > 1 else (
        ParallelState.single())  # fmt: skip
    config = _config(args, seq)
    layer = TransformerLayer(config, state.tp, RNGTracker(1, 0), sequence_parallel=False,
                             cp=state.cp).train()  # fmt: skip
    layer.self_attention.cp_comm_type = comm if world > 1 else "p2p"
    rotary = RotaryEmbedding(config.head_dim, seq)
    x = torch.randn(seq // world, args.batch, args.hidden, requires_grad=True)
    return saved_activation_bytes(lambda: layer(x, rotary), layer.parameters())


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for seq in args.seq:
        one_rank = None
        for cp, comm in LAYOUTS:
            start = time.perf_counter()
            if cp == 1:
                per_rank = [_layer_bytes(0, 1, args, seq, comm)]
            else:
                per_rank = run_distributed(_layer_bytes, cp, args, seq, comm, timeout=900)
            measured = max(per_rank)
            one_rank = measured if cp == 1 else one_rank
            formula = layer_activation_bytes(_config(args, seq), args.batch, cp=cp,
                                             cp_comm_type=comm if cp > 1 else "p2p")  # fmt: skip
            row = {
                "seq": seq, "cp": cp, "comm_type": comm, "measured_bytes": measured,
                "ranks_equal": len(set(per_rank)) == 1, "formula_bytes": formula,
                "one_rank_over_cp_bytes": one_rank / cp, "ratio_to_one_rank_over_cp":
                measured / (one_rank / cp), "bytes_per_token": measured / (seq // cp),
                "seconds": time.perf_counter() - start,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{seq:6d} {cp:3d} {comm:>10} {measured / _MB:10.2f} {formula / _MB:10.2f} "
                f"{one_rank / cp / _MB:10.2f} {row['ratio_to_one_rank_over_cp']:8.3f} "
                f"{row['bytes_per_token']:10.0f}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq = [1024, 2048]
    torch.set_num_threads(1)
    print(f"activation bytes per rank of one layer (hidden {args.hidden}, {args.heads} heads, "
          f"{args.groups} query groups, rope, fp32, micro-batch {args.batch}); MiB")  # fmt: skip
    print(f"{'S':>6} {'CP':>3} {'comm':>10} {'measured':>10} {'formula':>10} {'1-rank/CP':>10} "
          f"{'ratio':>8} {'B/token':>10}")  # fmt: skip
    rows = measure(args)
    result = {"rows": rows, **run_record("context_parallel_memory", args)}
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    off = [r for r in rows if r["measured_bytes"] != r["formula_bytes"]]
    if off:
        raise SystemExit(f"{len(off)} rows differ from the formula: {off[0]}")
    return result


if __name__ == "__main__":
    main()
