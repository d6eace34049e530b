"""The multi-node launch path on one host: two torchrun agents (one per simulated node) that meet
through torchrun's c10d rendezvous, as `examples/pretrain_gpt_multinode_slurm.sh` launches them,
must train to the same losses as one standalone agent with the same world size.

Losses are read from the log line the last rank prints, with a regex written out here; the two
agents' stdout is concatenated, since either agent may hold the last rank (c10d assigns node ranks
in arrival order).
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "pretrain_gpt.py")
TIMEOUT_S = 120
TRAIN_ITERS = 4
FLAGS = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(TRAIN_ITERS), "--lr", "3e-3", "--log-interval", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
    "--mock-data", "--eval-iters", "0", "--vocab-size", "256",
]  # fmt: skip
LOSS = re.compile(r"^ iteration +(\d+)/ +\d+ \|.* lm loss: (\d\.\d{6}E[+-]\d\d) \|")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, SCRIPT, *FLAGS]


def _run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Start every command at once (the agents must rendezvous), wait with a timeout, and kill
    whatever is left, so a failed rendezvous can never hang the suite."""
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in commands
    ]
    results = []
    try:
        for cmd, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _losses(stdout: str) -> dict[int, float]:
    found = [LOSS.match(line) for line in stdout.splitlines()]
    return {int(m[1]): float(m[2]) for m in found if m}


@pytest.mark.slow
def test_two_agents_with_c10d_rendezvous_match_one_standalone_agent() -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    rdzv_id = f"megapipe-test-{uuid.uuid4().hex[:8]}"
    node = [
        "--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
    ]  # fmt: skip
    # All three agents at once: the reference run computes while the two agents rendezvous.
    *two_nodes, single = _run_all(
        [_torchrun(*node), _torchrun(*node), _torchrun("--standalone", "--nproc_per_node", "4")]
    )
    for i, result in enumerate(two_nodes):
        assert result.returncode == 0, f"agent {i} failed:\n{result.stderr[-3000:]}"
    multi = _losses("".join(r.stdout for r in two_nodes))
    # One agent's stdout has the log lines, the other's none: only the last rank prints them.
    assert sorted(bool(_losses(r.stdout)) for r in two_nodes) == [False, True]
    assert single.returncode == 0, single.stderr[-3000:]
    reference = _losses(single.stdout)

    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1)), single.stdout
    assert sorted(multi) == sorted(reference)
    assert reference[1] == pytest.approx(math.log(256), abs=0.2)  # a real, near-uniform loss
    header = "using world size: 4, data-parallel size: 1, tensor-model-parallel size: 2"
    assert header in "".join(r.stdout for r in two_nodes)
    for it, loss in reference.items():
        assert multi[it] == pytest.approx(loss, rel=1e-6), (it, multi, reference)
