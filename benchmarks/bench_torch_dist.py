"""Save and load time and bytes on disk of a `torch_dist` checkpoint: --mb MB of fp32 shards
split by rows over --ranks forked gloo ranks (median of --repeats), then loaded at the same
split, resharded by columns, and whole in one process; the sha256 verification share; and
the time an AsyncSaver.save blocks the caller (staging copy) against a blocking save.

    python benchmarks/bench_torch_dist.py             # 50 MB on 2 ranks, ~10 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.async_save import AsyncSaver
from megapipe.checkpointing.shards import TensorShard
from megapipe.checkpointing.torch_dist import load_sharded, save_sharded
from megapipe.testing import run_distributed

COLS = 1024


def _shapes(mb: float, tensors: int = 8) -> dict[str, tuple[int, int]]:
    rows = int(mb * 2**20 / 4 / COLS / tensors) // 8 * 8
    return {f"decoder.layers.{i}.mlp.linear_fc1.weight": (rows, COLS) for i in range(tensors)}


def _pieces(shapes: dict, rank: int, world: int, by: str, fill: bool) -> dict:
    out = {}
    for name, shape in shapes.items():
        dim = 0 if by == "rows" else 1
        step = shape[dim] // world
        size = list(shape)
        size[dim] = step
        offsets = [0, 0]
        offsets[dim] = rank * step
        t = torch.randn(size) if fill else torch.empty(size)
        out[name] = [TensorShard(t, tuple(offsets), shape)]
    return out


def _rank(rank: int, world: int, root: str, mb: float, repeats: int) -> dict:
    group = dist.new_group(list(range(world)), backend="gloo")
    shapes = _shapes(mb)
    saved = _pieces(shapes, rank, world, "rows", fill=True)
    times: dict[str, list[float]] = {"save": [], "load": [], "load_cols": [], "verify": []}
    for i in range(repeats):
        directory = os.path.join(root, f"iter_{i:07d}")
        dist.barrier(group)
        t0 = time.perf_counter()
        save_sharded(directory, saved, {"iteration": i}, group=group, coordinator=rank == 0)
        times["save"].append(time.perf_counter() - t0)
        for key, by in (("load", "rows"), ("load_cols", "cols")):
            dest = _pieces(shapes, rank, world, by, fill=False)
            dist.barrier(group)
            t0 = time.perf_counter()
            load_sharded(directory, dest, group=group)
            times[key].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        atomic_dir.verify_files(directory, [f"__{rank}_0.distcp"])
        times["verify"].append(time.perf_counter() - t0)
    saver = AsyncSaver(group)  # a group used for checkpointing only, as AsyncSaver requires
    times["async_blocked"] = []
    for i in range(repeats):
        dist.barrier(group)
        directory = os.path.join(root, f"async_{i:07d}")
        times["async_blocked"].append(
            saver.save(directory, saved, {"iteration": i}, coordinator=rank == 0)
        )
        saver.wait()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_distributed(_rank, args.ranks, root, args.mb, args.repeats, timeout=600)
        directory = os.path.join(root, "iter_0000000")
        sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)}
        shapes = _shapes(args.mb)
        whole = {n: [TensorShard(torch.empty(s), (0, 0), s)] for n, s in shapes.items()}
        t0 = time.perf_counter()
        load_sharded(directory, whole, group=None)
        one = time.perf_counter() - t0
    payload = sum(4 * r * c for r, c in shapes.values())
    result = {
        "payload_bytes": payload,
        "bytes_on_disk": sum(sizes.values()),
        "files": sizes,
        "ranks": args.ranks,
        "save_s": max(r["save"] for r in per_rank),
        "load_same_split_s": max(r["load"] for r in per_rank),
        "load_resharded_cols_s": max(r["load_cols"] for r in per_rank),
        "load_whole_one_process_s": one,
        "verify_own_shard_s": max(r["verify"] for r in per_rank),
        "async_save_blocked_s": max(r["async_blocked"] for r in per_rank),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
