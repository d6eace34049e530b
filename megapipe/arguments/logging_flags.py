"""Flags for evaluation, logging (throughput, TensorBoard) and checkpoints."""

from __future__ import annotations

import argparse


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
