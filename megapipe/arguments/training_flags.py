"""Flags for the training loop, the optimizer, mixed precision and the learning rate."""

from __future__ import annotations

import argparse
import signal


def signal_number(text: str) -> int:
    """`SIGUSR1`, `USR1` or `10` -> 10 (--exit-signal)."""
    name = text.strip().upper()
    if name.isdigit() and int(name) in {s.value for s in signal.Signals}:
        return int(name)
    name = name if name.startswith("SIG") else "SIG" + name
    if name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"):
        return signal.Signals[name].value
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a signal that can be caught (a name like SIGUSR1 or USR1, or a number)"
    )


def add_training_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--micro-batch-size",
        type=int,
        required=True,
        help="Batch size per model instance (local batch size). Global batch size is local "
        "batch size times data-parallel size times number of micro batches.",
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Training batch size. Default: --micro-batch-size x data-parallel size; a larger "
        "value means gradient accumulation over micro-batches.",
    )
    group.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="Batch size ramp-up: start at START, grow by INCREMENT up to --global-batch-size "
        "over SAMPLES samples (the number of micro-batches per step grows with it). Unlike "
        "Megatron-LM, also allowed with --train-iters.",
    )
    group.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Total number of iterations to train (or give --train-samples).",
    )
    group.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Total number of samples to train on (instead of --train-iters).",
    )
    group.add_argument(
        "--lr",
        type=float,
        required=True,
        help="Peak learning rate; warmup and decay follow --lr-decay-style.",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Random seed of parameter initialisation (drawn per parameter name), dropout "
        "masks, mock data and dataset shuffles. Default: 1234.",
    )
    group.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Exit after the first iteration divisible by this value.",
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="Exit the program after this many minutes of training (all ranks agree).",
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM or SIGINT (or --exit-signal), finish the current iteration on every "
        "rank, save a checkpoint (with --save) and exit with status 0; a second signal exits "
        "at once with a non-zero status.",
    )
    group.add_argument(
        "--exit-signal",
        type=signal_number,
        default=signal.SIGTERM.value,
        metavar="SIGNAL",
        help="The signal --exit-signal-handler stops on besides SIGTERM and SIGINT, by name or "
        "number (SIGUSR1, USR1, 10: e.g. SLURM's --signal=USR1@120 pre-emption warning). "
        "Default: SIGTERM.",
    )
    group.add_argument(
        "--exit-signal-handler-for-dataloader",
        action="store_true",
        help="Accepted for Megatron-LM compatibility: megapipe reads samples in the training "
        "process (no loader workers), so --exit-signal-handler already covers it.",
    )
    group.add_argument(
        "--skip-train",
        action="store_true",
        help="Skip training: only evaluate on the validation and test splits.",
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="Iterations between log lines (loss and timing). Default: 100.",
    )


def add_optimizer_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--optimizer",
        default="adam",
        help="adam (AdamW, decoupled weight decay, as Megatron-LM) or sgd. Default: adam.",
    )
    add("--adam-beta1", type=float, default=0.9, help="Adam beta1. Default: 0.9.")
    add("--adam-beta2", type=float, default=0.999, help="Adam beta2. Default: 0.999.")
    add("--adam-eps", type=float, default=1e-8, help="Adam epsilon. Default: 1e-8.")
    add("--sgd-momentum", type=float, default=0.9, help="SGD momentum. Default: 0.9.")
    add(
        "--weight-decay",
        type=float,
        default=0.01,
        help="Weight decay (not applied to biases and norm weights). Default: 0.01.",
    )
    add(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip the global gradient norm (whole "
        "model, all ranks) to this value; 0 disables. Default: 1.0.",
    )
    add(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard fp32 master weights and optimizer state over data-parallel ranks (ZeRO-1).",
    )
    add(
        "--overlap-grad-reduce",
        action="store_true",
        help="Reduce each gradient bucket over "
        "data-parallel ranks asynchronously as soon as it is ready during backward.",
    )
    add(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Elements per gradient bucket. Default: 40,000,000.",
    )
    add(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accepted for "
        "Megatron-LM compatibility: gradients are always accumulated and reduced in fp32.",
    )
    add(
        "--bf16",
        action="store_true",
        help="bf16 parameters and activations, fp32 master weights and gradients.",
    )
    add(
        "--fp16",
        action="store_true",
        help="fp16 parameters and activations with loss scaling, "
        "fp32 master weights and gradients.",
    )
    add(
        "--loss-scale",
        type=float,
        default=None,
        help="Static fp16 loss scale (a power of 2); default: dynamic loss scaling.",
    )
    add(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="Initial dynamic loss scale. Default: 2^32.",
    )
    add("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale. Default: 1.")
    add(
        "--loss-scale-window",
        type=int,
        default=1000,
        help="Clean iterations before the dynamic loss scale doubles. Default: 1000.",
    )
    add(
        "--hysteresis",
        type=int,
        default=2,
        help="Overflows tolerated before the dynamic loss scale backs off. Default: 2.",
    )
    add(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="Stop, on every rank and before the optimizer step, when the loss or the gradient "
        "norm is NaN/Inf, naming the iteration and the rank (fp16 overflows are still skipped "
        "by the loss scaler). Default: on.",
    )
    add(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Train on through a NaN/Inf loss or gradient.",
    )
    add(
        "--check-for-spiky-loss",
        action="store_true",
        help="Report an iteration whose loss exceeds --spiky-loss-factor times the mean of "
        "the previous (up to 100) iterations' losses.",
    )
    add(
        "--spiky-loss-factor",
        type=float,
        default=10.0,
        help="What --check-for-spiky-loss calls a spike, as a multiple of the running mean "
        "(Megatron-LM's SPIKY_LOSS_FACTOR). Default: 10.",
    )
    add(
        "--exit-on-spiky-loss",
        action="store_true",
        help="With --check-for-spiky-loss: stop before the optimizer step of a spiky "
        "iteration instead of warning.",
    )
    add(
        "--overlap-param-gather",
        action="store_true",
        help="With --use-distributed-optimizer: all-gather the updated parameters "
        "asynchronously, each bucket waited for just before the next forward first uses it.",
    )
    add(
        "--min-lr",
        type=float,
        default=0.0,
        help="Minimum learning rate the decay reaches. Default: 0.",
    )
    add(
        "--lr-decay-style",
        default="linear",
        help="constant, linear, cosine, inverse-square-root or WSD. Default: linear.",
    )
    add(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay over. Default: --train-iters.",
    )
    add(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="Samples to decay over (with --train-samples). Default: --train-samples.",
    )
    add("--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup. Default: 0.")
    add(
        "--lr-warmup-samples",
        type=int,
        default=0,
        help="Samples of linear warmup (with --train-samples). Default: 0.",
    )
    add(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    add(
        "--lr-warmup-init",
        type=float,
        default=0.0,
        help="Learning rate at the start of warmup. Default: 0.",
    )
    add(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: iterations of the final decay phase.",
    )
    add(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="WSD: samples of the final decay phase (with --train-samples).",
    )
    add(
        "--lr-wsd-decay-style",
        default="exponential",
        help="WSD decay: exponential, linear, cosine or minus_sqrt. Default: exponential.",
    )
    add(
        "--decoupled-lr",
        type=float,
        default=None,
        help="Peak learning rate of the input embedding and output layer (the word embeddings, "
        "the output layer when untied; a tied copy counts as embedding), with the schedule of "
        "--lr (same warmup and decay); the other parameters keep --lr. Default: --lr.",
    )
    add(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="Minimum learning rate the --decoupled-lr schedule decays to. Default: --min-lr.",
    )
    add(
        "--override-opt_param-scheduler",
        action="store_true",
        help="On resuming, take the learning-rate and weight-decay schedule (--lr, --min-lr, "
        "warmup, decay iterations and style, --weight-decay, --decoupled-lr) from the command "
        "line where it differs from the checkpoint's; the schedule's position (samples trained) "
        "still comes from the checkpoint.",
    )
    add(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="On resuming, continue the learning-rate and weight-decay schedule saved in the "
        "checkpoint, ignoring the command line's schedule flags. Without this or "
        "--override-opt_param-scheduler, a schedule that differs from the checkpoint's is an "
        "error.",
    )
