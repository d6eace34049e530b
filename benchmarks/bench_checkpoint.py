"""Checkpoints of the training product: save/load time and bytes per rank for the demo-size
model, and the resharding matrix (saved at one layout, continued at others) with the worst
loss difference against the run that never stopped.

Runs `pretrain_gpt.py` in-process on forked gloo CPU ranks (megapipe.testing), with mock data:

    python benchmarks/bench_checkpoint.py            # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

from megapipe.atomic_files import write_json
from megapipe.testing import run_distributed, train_with_flags

DEMO = [  # examples/pretrain_gpt_demo_cpu.sh's model, on mock data with a 4000-token vocabulary
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "2e-3", "--mock-data", "--vocab-size", "4000",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0",
    "--log-interval", "1",
]  # fmt: skip
LAYOUTS = {
    "tp2-pp2-dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                        "2", "--num-layers-per-virtual-pipeline-stage", "1",
                        "--use-distributed-optimizer"]),
    "tp1-pp4-dp2": (8, ["--pipeline-model-parallel-size", "4", "--use-distributed-optimizer"]),
    "tp4-pp1-dp2": (8, ["--tensor-model-parallel-size", "4", "--use-distributed-optimizer"]),
    "tp2-pp1-dp1": (2, ["--tensor-model-parallel-size", "2"]),
    "1 rank": (1, []),
}  # fmt: skip
SAVED = re.compile(r"successfully saved checkpoint .*; training held up (\S+) s")
LOADED = re.compile(r"successfully loaded checkpoint .* in (\S+) s")


def _run(world: int, flags: list[str]) -> tuple[list, str]:
    outputs = run_distributed(train_with_flags, world, flags, timeout=600)
    return outputs[0][0], outputs[0][1]  # rank 0 prints the checkpoint lines


def _bytes_per_file(directory: str) -> dict[str, int]:
    """Every file under `directory` (relative path -> bytes)."""
    return {
        os.path.relpath(os.path.join(root, name), directory): os.path.getsize(
            os.path.join(root, name)
        )
        for root, _, names in os.walk(directory)
        for name in names
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/out/checkpoint.json")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="megapipe-bench-ckpt-")
    report: dict = {"model": "demo (4 layers, hidden 128, seq 64, vocab 4000)"}

    # save and load time, bytes per rank: PP=2 on 2 ranks, as the demo runs, in both formats
    flags = DEMO + ["--pipeline-model-parallel-size", "2", "--train-iters", "4"]
    report["formats"] = {}
    for fmt in ("torch_dist", "torch"):
        save = os.path.join(work, f"pp2-{fmt}")
        ckpt = ["--ckpt-format", fmt]
        _, out = _run(2, flags + ckpt + ["--save", save, "--save-interval", "2",
                                         "--exit-interval", "2"])  # fmt: skip
        _, load_out = _run(2, flags + ckpt + ["--load", save, "--exit-interval", "3"])
        files = _bytes_per_file(os.path.join(save, "iter_0000002"))
        entry = {"save_s": float(SAVED.findall(out)[0]),
                 "load_s": float(LOADED.findall(load_out)[0]), "files": files}  # fmt: skip
        report["formats"][fmt] = entry
        print(f"demo model, PP=2 on 2 CPU ranks, {fmt}: save {entry['save_s']:.2f} s, "
              f"load {entry['load_s']:.2f} s")  # fmt: skip
        for name, size in sorted(files.items()):
            print(f"  {name:44s} {size:12,d} bytes")

    # resharding matrix: save at TP2 x PP2 x DP2 after 3 iterations, continue 3 more elsewhere
    world, layout = LAYOUTS["tp2-pp2-dp2"]
    train = DEMO + ["--train-iters", "6"]
    reference, _ = _run(world, train + layout)
    save3d = os.path.join(work, "3d")
    _run(world, train + layout + ["--save", save3d, "--exit-interval", "3"])
    rows = []
    for name, (world, layout) in LAYOUTS.items():
        continued, _ = _run(world, train + layout + ["--load", save3d])
        worst = max(
            abs(a.lm_loss - b.lm_loss) / abs(b.lm_loss) for a, b in zip(continued, reference[3:])
        )
        rows.append({"loaded_at": name, "worst_relative_loss_difference": worst})
        print(f"saved at tp2-pp2-dp2, loaded at {name:12s}: worst relative loss difference "
              f"{worst:.2e} over iterations 4-6")  # fmt: skip
    report["resharding"] = rows
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
