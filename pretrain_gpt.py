"""Pre-train a GPT model: `torchrun --nproc_per_node N pretrain_gpt.py <Megatron-LM flags>`.

Thin on purpose: parse and validate -> join the process group -> build groups -> train.
Validation runs before any process group exists, identically on every rank, so a bad flag makes
every rank exit with status 2 and one line on stderr instead of a hang or a traceback. Bad data
or a bad checkpoint found later exits with status 1 and one line. `--debug` (or MEGAPIPE_DEBUG=1)
prints the traceback above that line.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

import torch.distributed as dist

from megapipe.arguments import PROG, parse_args
from megapipe.console import say
from megapipe.errors import ConfigError, run_cli
from megapipe.parallel import ParallelState, initialize_distributed
from megapipe.parallel.initialize import MAX_CONNECTIONS_VAR, max_connections_warning
from megapipe.stack_dump import install_stack_dump
from megapipe.training import train


def _world_size() -> int:
    """The job's size as torchrun announces it; 1 for a plain `python pretrain_gpt.py`."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable WORLD_SIZE={value!r} is not an integer") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank of the job; returns the process exit status: any megapipe error ends it
    with one line and the error's status (2 for a bad setting, 1 for bad data, a bad
    checkpoint, a numerical fault or a failed peer; `--debug` adds the traceback)."""
    return run_cli(PROG, _run, argv)


def _run(argv: list[str]) -> int:
    install_stack_dump()  # `kill -USR2 PID`: every thread's stack, and the run goes on
    world_size = _world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reported below, once, from rank 0
        configs = parse_args(argv, world_size)
    if os.environ.get("RANK", "0") == "0":
        for note in configs.warnings:
            say(f"{PROG}: warning: {note}")

    parallel = configs.parallel
    device = initialize_distributed(
        parallel.distributed_backend, timeout_minutes=parallel.distributed_timeout_minutes
    )
    note = max_connections_warning(
        os.environ.get(MAX_CONNECTIONS_VAR),
        device_type=device.type,
        tp_size=parallel.tensor_model_parallel_size,
        tp_comm_overlap=parallel.tp_comm_overlap,
    )
    if note is not None and os.environ.get("RANK", "0") == "0":
        say(f"{PROG}: warning: {note}")
    try:
        state = ParallelState.build(
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            device,
            context_parallel_size=parallel.context_parallel_size,
            data_parallel_instances=configs.optimizer.num_distributed_optimizer_instances,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
        )
        train(configs, state)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
