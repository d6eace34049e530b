"""`python tests/elastic_launch.py --nproc 4 --max-restarts 1 -- <pretrain_gpt.py flags>`

Runs pretrain_gpt.py on CPU ranks under torch's elastic agent, the machinery `torchrun
--standalone --nproc_per_node N --max-restarts R` runs (the same agent, c10d rendezvous on a
free port, restarts, TORCHELASTIC_RESTART_COUNT and the teardown of the other ranks when one
fails), with one difference: the ranks are forked from this process, which has imported torch
and megapipe once, instead of each attempt starting N new interpreters that import them again
(about 5 CPU-seconds per rank). That is what lets the fault tests restart a 4-rank job several
times within their CI budget; tools/stress_kill.py runs the real `torchrun` command.
Exits 0 when the job succeeded, 1 when it failed after its restarts (with torchrun's report).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

import megapipe.training  # noqa: E402, F401  (imported once, before the ranks are forked)
import pretrain_gpt  # noqa: E402


def _rank(argv: list[str]) -> None:
    """One rank: pretrain_gpt's main, its status as the process's exit status."""
    torch.set_num_threads(1)
    status = pretrain_gpt.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if status:
        sys.exit(status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=int, default=30)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=args.max_restarts,
        monitor_interval=0.1,
        start_method="fork",
        shutdown_timeout=args.shutdown_timeout,
    )
    sys.stdout.flush()
    try:
        elastic_launch(config, _rank)(flags)
    except ChildFailedError as error:
        sys.stderr.write(error.format_msg() + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
