"""Flags for tensor, pipeline, context and sequence parallelism and the process-group backend."""

from __future__ import annotations

import argparse

from megapipe.config import NCCL_EMULATION_CHOICES, NCCL_RULES
from megapipe.errors import ConfigError


def _seconds(text: str) -> float:
    """A non-negative number of seconds (or factor), for the watchdog's flags."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number")
    return value


def add_distributed_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Degree of tensor model parallelism. Default: 1.",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Degree of pipeline model parallelism. Default: 1.",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Degree of context parallelism: each sequence split over this many ranks (2 x CP "
        "load-balanced chunks). Default: 1. The process groups and the data split are in "
        "place; sizes above 1 are refused until its attention is wired into training.",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Degree of expert parallelism (MoE): each MoE layer's experts split over this "
        "many ranks of each data-parallel x context-parallel group. Default: 1.",
    )
    group.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        help="How context-parallel attention exchanges keys and values: p2p (a ring of "
        "send/receive overlapped with compute), all_gather, or a2a (all-to-all over the heads, "
        "needs heads and query groups per TP rank divisible by CP). Default: p2p. One value "
        "for every layer (a per-layer list and a2a+p2p are not supported yet).",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual pipeline stage (model chunk); turns on the interleaved "
        "schedule with --num-layers / (PP x this) chunks per pipeline rank.",
    )
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (the interleaved schedule); an alternative to "
        "--num-layers-per-virtual-pipeline-stage.",
    )
    group.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Transformer layers on the first pipeline stage (the rest split evenly).",
    )
    group.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Transformer layers on the last pipeline stage (the rest split evenly).",
    )
    group.add_argument(
        "--pipeline-schedule",
        default=None,
        help="1f1b, gpipe, interleaved-1f1b, zero-bubble-h1 (ZB-H1: backward split into input "
        "and deferred weight gradients, 1F1B's memory, a third of its bubble) or "
        "interleaved-zero-bubble (the same on virtual stages). Default: 1f1b, or "
        "interleaved-1f1b with virtual stages.",
    )
    group.add_argument(
        "--pipeline-partition",
        default="uniform",
        help="How layers are split over stages: uniform (Megatron-LM's rule), balanced "
        "(equal FLOPs per stage counting the output layer on the last stage) or memory (equal "
        "estimated peak memory per stage, counting the micro-batches each stage keeps in "
        "flight; one chunk per rank). Default: uniform.",
    )
    group.add_argument(
        "--pipeline-p2p-timeout",
        type=float,
        default=300.0,
        help="Seconds a pipeline stage waits for a neighbour before failing with an error that "
        "names it. Default: 300.",
    )
    group.add_argument(
        "--overlap-p2p-communication",
        dest="overlap_p2p_communication",
        action="store_true",
        default=True,
        help="Post a pipeline receive one compute unit early where the unit it moves over "
        "sends nothing, so that the transfer overlaps that unit's compute (the default). Safe "
        "under what NCCL and CUDA promise: no send of the rank moves behind the receive "
        "(docs/pipeline-schedules.md).",
    )
    group.add_argument(
        "--emulate-nccl-p2p-order",
        nargs="*",
        choices=NCCL_EMULATION_CHOICES,
        metavar="RULE",
        help="Debugging, gloo only: run the pipeline's and the context-parallel ring's "
        "transfers under NCCL's rules, so that an order that would hang on GPUs hangs (and "
        "times out naming the peer) on the CPU too. Every communicator's group calls run in "
        "posting order, plus the rules named: 'handshake' (a rank's first call with a peer "
        "blocks its host until the peer's first call there), 'one-queue' (all of a rank's "
        "calls, and its collectives, in one queue); 'streams' for neither. Without a RULE: "
        "both (the worst case NCCL and CUDA allow). Slower; off by default.",
    )
    group.add_argument(
        "--no-overlap-p2p-communication",
        dest="overlap_p2p_communication",
        action="store_false",
        help="Post each pipeline receive just before the compute that needs it.",
    )
    group.add_argument(
        "--pipeline-trace",
        default=None,
        metavar="PATH",
        help="Write the measured start and end of every pipeline action on every rank (first "
        "10 iterations) as Chrome-trace JSON to PATH (open in Perfetto or chrome://tracing).",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Enable sequence parallelism (needs --tensor-model-parallel-size > 1).",
    )
    group.add_argument(
        "--tp-comm-overlap",
        dest="tp_comm_overlap",
        action="store_true",
        default=True,
        help="Overlap the tensor-parallel linears' backward collectives (input-gradient "
        "all-reduce or reduce-scatter, the sequence-parallel re-gather) with the next matmul. "
        "On by default.",
    )
    group.add_argument(
        "--no-async-tensor-model-parallel-allreduce",
        dest="tp_comm_overlap",
        action="store_false",
        help="Wait for each tensor-parallel backward collective at once (no overlap).",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="Minutes a collective waits for its peers before failing (every process group, "
        "gloo and NCCL). Default: 10.",
    )
    group.add_argument(
        "--watchdog-timeout-factor",
        type=_seconds,
        default=10.0,
        help="End a rank (exit status 3, naming the operation it waits in) whose step runs "
        "longer than this many times the median of its recent steps; 0 turns the watchdog "
        "off. Default: 10.",
    )
    group.add_argument(
        "--watchdog-min-seconds",
        type=_seconds,
        default=60.0,
        help="The watchdog never ends a step before it has run this long. Default: 60.",
    )
    group.add_argument(
        "--watchdog-max-seconds",
        type=_seconds,
        default=None,
        help="How long the watchdog lets anything without a step-time history (the first "
        "step, an evaluation, a checkpoint save) go without starting a new operation. "
        "Default: --distributed-timeout-minutes plus one minute.",
    )
    group.add_argument(
        "--distributed-backend",
        default=None,
        help="Which backend to use for distributed training: nccl or gloo. "
        "Default: nccl when CUDA is available, else gloo.",
    )


def virtual_stages(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank, from either of Megatron's two spellings."""
    per_stage, per_rank = (
        args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank,
    )
    if per_stage is not None and per_rank is not None:
        raise ConfigError(
            "pass one of --num-layers-per-virtual-pipeline-stage and "
            "--num-virtual-stages-per-pipeline-rank, not both"
        )
    if per_rank is not None:
        if per_rank < 1:
            raise ConfigError(
                f"--num-virtual-stages-per-pipeline-rank must be positive, got {per_rank}"
            )
        return per_rank
    if per_stage is None:
        return 1
    pp = args.pipeline_model_parallel_size
    if per_stage < 1 or pp < 1 or args.num_layers % (pp * per_stage):
        raise ConfigError(
            f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({pp}) x --num-layers-per-virtual-pipeline-stage ({per_stage})"
        )
    return args.num_layers // (pp * per_stage)


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def cp_comm_type(args: argparse.Namespace) -> str:
    """The one --cp-comm-type of every layer; Megatron's per-layer list and hierarchical
    a2a+p2p are refused by name."""
    values = list(args.cp_comm_type)
    if len(values) != 1:
        raise ConfigError(
            f"--cp-comm-type {' '.join(values)}: a communication type per layer is not "
            "supported yet; give one of p2p, all_gather, a2a for every layer"
        )
    value = values[0]
    if value == "a2a+p2p":
        raise ConfigError(
            "--cp-comm-type a2a+p2p (hierarchical context parallelism) is not supported yet; "
            "use p2p, all_gather or a2a"
        )
    if value not in CP_COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {value!r} is not one of {', '.join(CP_COMM_TYPES)}")
    return value


def nccl_emulation_rules(value: list[str] | None) -> tuple[str, ...]:
    """--emulate-nccl-p2p-order's rules: none when the flag is absent, every rule NCCL allows
    (NCCL_RULES) for the bare flag, else the ones named (sorted, each once)."""
    if value is None:
        return ()
    return tuple(sorted(set(value))) if value else NCCL_RULES
