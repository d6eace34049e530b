"""Join the job's default process group from torchrun's environment."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    """NCCL when CUDA is present, else gloo (CPU ranks on one or many hosts)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(
    backend: str | None = None, timeout_minutes: float = 10.0
) -> torch.device:
    """Initialise torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR (set by torchrun).

    Without those variables (a plain `python pretrain_gpt.py`) this starts a one-rank world on
    a free local port, so the same script runs with or without torchrun. Returns the device
    this rank computes on: cuda:LOCAL_RANK with NCCL, cpu with gloo.
    """
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "--distributed-backend nccl needs CUDA, which is not available here; use gloo"
        )
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
