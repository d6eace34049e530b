"""Flags for evaluation, logging (throughput, TensorBoard) and checkpoints."""

from __future__ import annotations

import argparse
import importlib.util

from megapipe.config import LoggingConfig
from megapipe.errors import ConfigError


def add_validation_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--eval-interval",
        type=int,
        default=1000,
        help="Evaluate on the validation split every this many iterations. Default: 1000.",
    )
    group.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="Global batches per evaluation; 0 disables evaluation. Default: 100.",
    )


def add_logging_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--log-throughput",
        action="store_true",
        help="Add TFLOP/s per GPU (from the model's FLOPs), tokens/s per GPU and, with a known "
        "peak, MFU to the log line.",
    )
    add(
        "--device-peak-tflops",
        type=float,
        default=None,
        help="Dense peak TFLOP/s of one device in the training precision, for MFU. Default: "
        "known for A100, H100 and H200 (bf16/fp16); none on CPU.",
    )
    add("--tensorboard-dir", default=None, help="Write TensorBoard logs to this directory.")
    add(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="Report to TensorBoard every this many iterations. Default: 1.",
    )
    add(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Events queued before TensorBoard's writer flushes to disk. Default: 1000.",
    )
    add(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Write the step's timers (forward-backward, optimizer) to TensorBoard.",
    )
    add(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Write the validation perplexity to TensorBoard.",
    )
    add(
        "--no-log-learning-rate-to-tensorboard",
        action="store_false",
        dest="log_learning_rate_to_tensorboard",
        help="Do not write the learning rate to TensorBoard.",
    )
    add(
        "--no-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Do not write the loss scale to TensorBoard.",
    )
    add(
        "--log-batch-size-to-tensorboard",
        action="store_true",
        help="Write the global batch size to TensorBoard.",
    )
    add_monitoring_args(group)


def add_monitoring_args(group: argparse._ArgumentGroup) -> None:
    """Megatron-LM's norm, memory, profiling and Weights & Biases flags."""
    add = group.add_argument
    add(
        "--log-params-norm",
        action="store_true",
        help="Add the L2 norm of all parameters (each element counted once, whatever the "
        "layout) to the log line (`params norm`) and TensorBoard (`params-norm`).",
    )
    add(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Add the number of zero elements in the fp32 gradients (each counted once) to the "
        "log line (`num zeros`) and TensorBoard (`num-zeros`).",
    )
    add(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Write the memory in use to TensorBoard: the CUDA allocator's mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes and mem-allocated-count; on CPU the "
        "process's mem-rss-bytes and mem-max-rss-bytes.",
    )
    add(
        "--log-world-size-to-tensorboard",
        action="store_true",
        help="Write the number of ranks to TensorBoard (`world-size`).",
    )
    add(
        "--profile",
        action="store_true",
        help="Profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks: "
        "with --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, else "
        "cudaProfilerStart/Stop and NVTX ranges for nsys (CUDA only).",
    )
    add(
        "--use-pytorch-profiler",
        action="store_true",
        help="With --profile: capture with torch.profiler and write a Chrome trace "
        "(*.pt.trace.json, for TensorBoard's profile plugin or Perfetto) to --tensorboard-dir.",
    )
    add(
        "--profile-step-start",
        type=int,
        default=10,
        help="First iteration --profile captures (1-based, as the log line counts). Default: 10.",
    )
    add(
        "--profile-step-end",
        type=int,
        default=12,
        help="Iteration at which --profile stops, not captured itself. Default: 12.",
    )
    add(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=[0],
        help="Global ranks that profile with --profile. Default: 0.",
    )
    add(
        "--wandb-project",
        default=None,
        help="Log the TensorBoard scalars to this Weights & Biases project too, from the "
        "TensorBoard writing rank (needs `pip install wandb`; WANDB_MODE=offline works "
        "without an account).",
    )
    add("--wandb-exp-name", default=None, help="The run's name in --wandb-project (required).")
    add(
        "--wandb-save-dir",
        default=None,
        help="Directory for wandb's local files. Default: SAVE/wandb with --save, else ./wandb.",
    )


def validate_monitoring(logging: LoggingConfig, world_size: int) -> list[str]:
    """ConfigError for a --profile or --wandb-* setting that cannot run (on every rank alike,
    before anything is built); notes for those flags given without the one they qualify."""
    notes = []
    start, end = logging.profile_step_start, logging.profile_step_end
    if logging.profile:
        if start <= 0:
            raise ConfigError(
                f"--profile-step-start must be positive (iterations count from 1), got {start}"
            )
        if end <= start:
            raise ConfigError(
                f"--profile-step-end ({end}) must be greater than --profile-step-start "
                f"({start}): the profiled iterations are [start, end)"
            )
        outside = [str(r) for r in logging.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(
                f"--profile-ranks {' '.join(outside)}: no such rank in a world of "
                f"{world_size} (ranks 0..{world_size - 1})"
            )
        if logging.use_pytorch_profiler and logging.tensorboard_dir is None:
            raise ConfigError(
                "--profile with --use-pytorch-profiler needs --tensorboard-dir (the trace is "
                "written there)"
            )
    elif logging.use_pytorch_profiler:
        notes.append("--use-pytorch-profiler has no effect without --profile")
    project = logging.wandb_project
    if project is None:
        for given, name in ((logging.wandb_exp_name, "--wandb-exp-name"),
                            (logging.wandb_save_dir, "--wandb-save-dir")):  # fmt: skip
            if given is not None:
                notes.append(f"{name} has no effect without --wandb-project")
        return notes
    if not logging.wandb_exp_name:
        raise ConfigError(
            f"--wandb-project {project} needs --wandb-exp-name (the run's name in the project)"
        )
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project {project} needs the wandb package: pip install wandb")
    return notes


def add_checkpoint_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--save", default=None, help="Directory to save checkpoints to (SAVE/iter_0000100/...).")
    add(
        "--load",
        default=None,
        help="Directory to load the latest checkpoint from (latest_checkpointed_iteration.txt); "
        "an empty one starts from scratch with a warning.",
    )
    add("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    add(
        "--ckpt-format",
        default="torch_dist",
        help="torch_dist: layout-free sharded checkpoints on torch.distributed.checkpoint, "
        "loadable at any TP/PP/DP layout; torch: Megatron's legacy per-rank layout "
        "(iter_N/mp_rank_TT_PPP/model_optim_rng.pt), loadable at the same layout or after "
        "tools/checkpoint/convert.py. Default: torch_dist.",
    )
    add("--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest.")
    add(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model's shape and tokenizer flags from the checkpoint --load names "
        "(megapipe's or Megatron-LM's); they win over the command line's, as in Megatron-LM. "
        "Without it, a --load checkpoint still gives the model flags the command line leaves "
        "out.",
    )
    add("--no-save-optim", action="store_true", help="Do not save the optimizer state.")
    add("--no-save-rng", action="store_true", help="Do not save the random states.")
    add("--no-load-optim", action="store_true", help="Do not load the optimizer state.")
    add("--no-load-rng", action="store_true", help="Do not load the random states.")
    add(
        "--finetune",
        action="store_true",
        help="Load the model weights only: optimizer, random states, iteration and data "
        "position start afresh.",
    )
    add(
        "--async-save",
        action="store_true",
        help="Write checkpoints in a background thread while training continues (at most "
        "one save in flight; training waits only to copy its state).",
    )
    add(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load: exit with an error if there is no checkpoint, instead of starting "
        "from scratch.",
    )
