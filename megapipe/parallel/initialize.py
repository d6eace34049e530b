"""Join the job's default process group from torchrun's environment.

Two things make a job restartable and bounded here:
- Under torchrun (TORCHELASTIC_RESTART_COUNT set), the process group's store keys are
  prefixed with the attempt number. torchrun keeps one store for the whole job, so without
  the prefix a restarted rank can read the address a dead rank of the previous attempt
  published and fail with "Gloo connectFullMesh failed ... Connection refused".
- Every process group gets --distributed-timeout-minutes: torch's `new_group` otherwise
  gives subgroups its backend default (30 minutes for gloo) whatever the world group has, so
  `new_group` callers pass `default_group_timeout()`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
MAX_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def default_backend() -> str:
    """NCCL when CUDA is present, else gloo (CPU ranks on one or many hosts)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_kwargs(backend: str, local_rank: int) -> dict[str, torch.device]:
    """`init_process_group`'s device argument: on NCCL `device_id=cuda:LOCAL_RANK`, which makes
    the communicator eagerly, bound to that device (no guessing the device at the first
    collective; what NCCL's split and some of its features need); on gloo none."""
    if backend == "nccl":
        return {"device_id": torch.device("cuda", local_rank)}
    return {}


def max_connections_warning(
    value: str | None, *, device_type: str, tp_size: int, tp_comm_overlap: bool
) -> str | None:
    """The start-up warning when the TP backward overlap cannot work as meant, else None.

    The TP linears start their input-gradient all-reduce (reduce-scatter under sequence
    parallelism) and compute the weight gradient meanwhile (layers/linear_function.py). On
    CUDA the collective's kernel must be queued on the GPU before the matmul's, which only one
    hardware work queue guarantees: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM requires it
    for the same overlap). value: the variable's value (None: unset)."""
    if device_type != "cuda" or tp_size <= 1 or not tp_comm_overlap or value == "1":
        return None
    shown = "unset" if value is None else f"{value!r}"
    return (
        f"{MAX_CONNECTIONS_VAR} is {shown}, but --tp-comm-overlap (on by default, with "
        f"--tensor-model-parallel-size {tp_size}) needs {MAX_CONNECTIONS_VAR}=1 so that each "
        "input-gradient all-reduce is queued before the weight-gradient matmul it overlaps; "
        f"export {MAX_CONNECTIONS_VAR}=1, or pass --no-async-tensor-model-parallel-allreduce"
    )


def initialize_distributed(
    backend: str | None = None, timeout_minutes: float = 10.0
) -> torch.device:
    """Initialise torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR (set by torchrun).

    Without those variables (a plain `python pretrain_gpt.py`) this starts a one-rank world
    whose store listens on a port picked while binding it (never a port looked up first and
    bound later, which two runs started together can both pick), so the same script runs with
    or without torchrun. Returns the device
    this rank computes on: cuda:LOCAL_RANK with NCCL, cpu with gloo.
    """
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            "--distributed-backend nccl needs CUDA, which is not available here; use gloo"
        )
    # No launcher (torchrun always sets MASTER_PORT); also true on a second call in-process.
    alone = "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        attempt = os.environ.get(RESTART_VAR)
        extra = init_kwargs(backend, local_rank)
        if alone:  # a store on a port the OS picks while binding it: two runs never collide
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            dist.init_process_group(
                backend, store=store, rank=0, world_size=1, timeout=timeout, **extra
            )
        elif attempt is None:
            dist.init_process_group(backend, timeout=timeout, **extra)
        else:
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"megapipe/attempt_{attempt}", store)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **extra
            )
    return device


def default_group_timeout() -> timedelta | None:
    """The default process group's timeout, for subgroups to share (None when unknown)."""
    if not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # torch internals moved: new_group's default
        return None
