"""Rank the layouts of a GPT model on a cluster by estimated step time and memory per GPU.

    python tools/plan.py --model-preset gpt3-1.3b --global-batch-size 512 --nodes 4
    python tools/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --vocab-size 50257 --global-batch-size 256 --cluster dgx-h100 --nodes 2
    python tools/plan.py --model-preset megatron-39.1b --explain --show-rejected
    python tools/plan.py --model-preset mixtral-8x7b --global-batch-size 1024 \\
        --cluster dgx-h100 --nodes 8 --moe-dispatchers alltoall,allgather

Searches TP, PP, VP, DP, micro-batch, recomputation, data-parallel sharding (plain, the
distributed optimizer = ZeRO-1, ZeRO-2, ZeRO-3 on FSDP2), every pipeline schedule megapipe
has, context parallelism for long sequences (--context-parallel-sizes, --cp-comm-types), and
for a mixture of experts (--num-experts, or a Mixtral preset) expert parallelism
(--expert-model-parallel-sizes, --moe-dispatchers);
prints the best layouts, why the first wins (its time and memory terms against the best of
each other TP x CP x PP), the bubble of each, one line on whether sharded data parallelism
(ZeRO-2/3 at TP1 PP1) fits and beats the best TP x PP layout on this cluster, and what was
rejected and why. The model behind the estimates is megapipe/planning (its docstrings state
every assumption). Exit status 2 with one line naming the flag for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from megapipe.config import ModelConfig, MoEConfig
from megapipe.errors import run_cli
from megapipe.model.activation_memory_moe import DISPATCHERS
from megapipe.model.context_parallel import COMM_TYPES
from megapipe.pipeline.schedules import SCHEDULE_KINDS
from megapipe.planning.cluster import GIB, PRESETS
from megapipe.planning.layout import RECOMPUTE_MODES, SHARDING
from megapipe.planning.presets import MEGATRON_WEAK_SCALING, MODELS, published_batch
from megapipe.planning.report import format_plan
from megapipe.planning.search import MIN_TOKENS_PER_CP_RANK, PlanOptions, plan
from megapipe.planning.time_model import TimeKnobs

PROG = "plan.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _number(convert: type, accept, what: str):
    """An argparse type: `convert(text)`, kept when `accept(value)`, else 'must be <what>'."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value:g}")
        return value

    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_positive_float = _number(float, lambda v: v > 0, "a positive number")
_non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")
_fraction = _number(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model (Megatron flag names, or a preset)")
    model.add_argument("--model-preset", choices=sorted(MODELS), help="A GPT-3 or Megatron size.")
    for names, help_text in (
        (("--num-layers", "--layers"), "Transformer layers."),
        (("--hidden-size", "--hidden"), "Hidden size."),
        (("--num-attention-heads", "--heads"), "Attention heads."),
        (("--num-query-groups", "--query-groups"), "Query groups (GQA); default: heads."),
        (("--vocab-size", "--vocab"), "Vocabulary (padded as Megatron does)."),
        (("--seq-length", "--seq"), "Sequence length."),
        (("--ffn-hidden-size", "--ffn"), "MLP size; default 4h (SwiGLU: Megatron's 8h/3)."),
        (("--kv-channels",), "Attention head dimension; default hidden / heads."),
        (
            ("--global-batch-size", "--global-batch"),
            "Sequences per step; default with --model-preset: the batch its paper trained with.",
        ),
    ):
        model.add_argument(*names, type=_positive_int, help=help_text)
    model.add_argument("--swiglu", action="store_true", help="SwiGLU MLP.")
    model.add_argument("--qk-layernorm", action="store_true", help="Norms over Q and K heads.")
    model.add_argument("--num-experts", type=_positive_int, help="Experts per MoE layer.")
    model.add_argument("--moe-router-topk", type=_positive_int, help="Experts per token (2).")
    model.add_argument("--moe-ffn-hidden-size", type=_positive_int, help="Each expert's ffn.")
    model.add_argument("--moe-layer-freq", type=_positive_int, help="Every N-th layer is MoE (1).")
    model.add_argument(
        "--moe-shared-expert-intermediate-size", type=_positive_int, help="Shared expert's ffn."
    )
    model.add_argument(
        "--moe-expert-capacity-factor",
        type=_positive_float,
        help="Capacity per expert (x tokens x topk / experts); default dropless.",
    )
    model.add_argument("--attention-dropout", type=_fraction, default=0.1)
    model.add_argument("--hidden-dropout", type=_fraction, default=0.1)

    cluster = parser.add_argument_group("cluster (a preset, any field overridden)")
    cluster.add_argument("--cluster", choices=sorted(PRESETS), default="dgx-a100")
    cluster.add_argument(
        "--nodes", type=_positive_int, help="Default 1 (Megatron presets: theirs)."
    )
    cluster.add_argument("--gpus-per-node", type=_positive_int)
    cluster.add_argument("--gpu-memory-gib", type=_positive_float)
    cluster.add_argument("--peak-tflops", type=_positive_float, help="Dense, training dtype.")
    cluster.add_argument("--intra-node-gbps", type=_positive_float, help="GB/s per GPU, one way.")
    cluster.add_argument("--inter-node-gbps", type=_positive_float, help="GB/s per GPU, one way.")
    cluster.add_argument("--matmul-efficiency", type=_fraction, help="Achieved fraction of peak.")
    cluster.add_argument(
        "--collective-latency-us",
        type=_non_negative_float,
        help="Fixed cost of each collective and pipeline send, in us.",
    )
    cluster.add_argument(
        "--memory-gbps",
        type=_positive_float,
        help="Device memory bandwidth, GB/s (read + write): FSDP2's buffer copies (ZeRO-2/3).",
    )
    cluster.add_argument(
        "--shard-collective-efficiency",
        type=_fraction,
        help="Fraction of the ring bandwidth reduce-scatters and all-gathers reach (1 on NCCL).",
    )

    search = parser.add_argument_group("search and assumptions")
    search.add_argument("--micro-batch-sizes", type=_int_list, default=(1, 2, 4, 8))
    search.add_argument("--recompute", default="none,selective,full",
                        help=f"Comma list of {', '.join(RECOMPUTE_MODES)}.")  # fmt: skip
    search.add_argument(
        "--sharding",
        help="Data-parallel sharding strategies to search: 'search' (default: all) or a comma "
        f"list of {', '.join(SHARDING)} (optim = the distributed optimizer, ZeRO-1; "
        "optim_grads = ZeRO-2; optim_grads_params = ZeRO-3, --use-torch-fsdp2).",
    )
    search.add_argument(
        "--distributed-optimizer",
        choices=("search", "on", "off"),
        help="The older switch, without ZeRO-2/3: search = no_shard,optim; on = optim; off = "
        "no_shard. Not with --sharding.",
    )
    search.add_argument("--schedules", help="Comma list (default: every schedule megapipe has).")
    search.add_argument(
        "--context-parallel-sizes",
        type=_int_list,
        help="CP sizes to search (--context-parallel-size), comma list. Default: 1, and for "
        f"long sequences every size leaving each rank >= {MIN_TOKENS_PER_CP_RANK} tokens.",
    )
    search.add_argument(
        "--cp-comm-types",
        default="p2p",
        help=f"Comma list of {', '.join(COMM_TYPES)} (--cp-comm-type) to search. Default p2p.",
    )
    search.add_argument(
        "--no-cp-overlap",
        action="store_true",
        help="The ring's (p2p) transfers do not overlap the block attention.",
    )
    search.add_argument(
        "--expert-model-parallel-sizes",
        type=_int_list,
        help="EP sizes to search (--expert-model-parallel-size), comma list. Default: every "
        "divisor of --num-experts (each layout keeps those dividing its DP x CP).",
    )
    search.add_argument(
        "--moe-dispatchers",
        default="alltoall",
        help="Comma list of alltoall, allgather (--moe-token-dispatcher-type) to search at "
        "EP > 1. Default alltoall.",
    )
    search.add_argument("--max-vp", type=_positive_int, default=4, help="Most chunks per rank.")
    search.add_argument("--allow-cross-node-tp", action="store_true")
    search.add_argument("--memory-fraction", type=_fraction, default=0.9,
                        help="Usable fraction of GPU memory. Default 0.9.")  # fmt: skip
    search.add_argument("--sequence-parallel", action="store_true")
    search.add_argument("--fp32", action="store_true", help="fp32 instead of bf16.")
    search.add_argument("--tp-overlap", type=_fraction, default=0.0, help="Hidden TP comm.")
    search.add_argument("--dp-overlap", type=_fraction, default=0.0, help="Hidden DP comm.")
    search.add_argument(
        "--param-gather-overlap",
        type=_fraction,
        default=0.0,
        help="Hidden fraction of ZeRO-2/3's per-micro-batch all-gathers (FSDP2 prefetch).",
    )
    search.add_argument(
        "--no-async-tensor-model-parallel-allreduce",
        action="store_true",
        help="Backward TP all-reduces not hidden under the weight-gradient "
        "matmuls (pretrain_gpt.py's flag of the same name).",
    )

    output = parser.add_argument_group("output")
    output.add_argument("--top", type=_positive_int, default=10)
    output.add_argument("--explain", action="store_true", help="Terms of every listed layout.")
    output.add_argument("--show-rejected", action="store_true", help="Each rejection's reason.")
    return parser


_MODEL_FIELDS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "vocab_size": "--vocab-size",
    "seq_length": "--seq-length",
}


def _model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelConfig:
    base = MODELS.get(args.model_preset)
    fields = {}
    for name, flag in _MODEL_FIELDS.items():
        value = getattr(args, name)
        if value is None and base is None:
            parser.error(f"{flag} is required (or --model-preset)")
        fields[name] = value if value is not None else getattr(base, name)
    ffn = args.ffn_hidden_size or (base.ffn_hidden_size if base is not None and
                                   fields["hidden_size"] == base.hidden_size else None)  # fmt: skip
    inherited = {}  # an MoE preset's shape beyond the flags (rope, norms, biases, ...)
    if base is not None and base.moe is not None:
        inherited = {name: getattr(base, name) for name in _PRESET_FIELDS}
    same = base is not None and base.moe is not None and fields["hidden_size"] == base.hidden_size
    model = ModelConfig(
        **{**fields, **inherited},
        ffn_hidden_size=ffn,
        num_query_groups=args.num_query_groups or (base.num_query_groups if same else None),
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        swiglu=args.swiglu or (base is not None and base.moe is not None and base.swiglu),
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        moe=_moe(args, parser, base.moe if base is not None else None, fields["num_layers"]),
    )
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        parser.error(f"--hidden-size ({model.hidden_size}) is not divisible by "
                     f"--num-attention-heads ({model.num_attention_heads})")  # fmt: skip
    if model.num_attention_heads % model.num_query_groups:
        parser.error(f"--num-attention-heads ({model.num_attention_heads}) is not divisible by "
                     f"--num-query-groups ({model.num_query_groups})")  # fmt: skip
    return model


_PRESET_FIELDS = ("position_embedding_type", "normalization", "add_bias_linear",
                  "untie_embeddings_and_output_weights")  # fmt: skip
_MOE_FLAGS = {
    "moe_router_topk": "--moe-router-topk",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_expert_capacity_factor": "--moe-expert-capacity-factor",
}


def _moe(
    args: argparse.Namespace, parser: argparse.ArgumentParser, base: MoEConfig | None, layers: int
) -> MoEConfig | None:
    """The MoE flags (over a preset's experts), or None for a dense model."""
    given = {name: getattr(args, name) for name in _MOE_FLAGS if getattr(args, name) is not None}
    if args.num_experts is None and base is None:
        if given:
            parser.error(f"{_MOE_FLAGS[next(iter(given))]} needs --num-experts")
        return None
    moe = base or MoEConfig(num_experts=args.num_experts)
    moe = dataclasses.replace(moe, num_experts=args.num_experts or moe.num_experts, **given)
    if moe.moe_router_topk > moe.num_experts:
        parser.error(f"--moe-router-topk ({moe.moe_router_topk}) is above --num-experts "
                     f"({moe.num_experts})")  # fmt: skip
    if isinstance(moe.moe_layer_freq, int) and moe.moe_layer_freq > layers:
        parser.error(f"--moe-layer-freq ({moe.moe_layer_freq}) is above --num-layers ({layers})")
    return moe


def _names(text: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser):
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if name not in allowed:
            parser.error(f"{flag}: {name!r} is not one of {', '.join(allowed)}")
    return names


def _sharding(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """--sharding's strategies, or --distributed-optimizer's older choice."""
    if args.sharding is not None and args.distributed_optimizer is not None:
        parser.error(
            "--sharding and --distributed-optimizer both choose the data-parallel sharding: "
            "pass one (--distributed-optimizer on is --sharding optim)"
        )
    if args.distributed_optimizer is not None:
        return {"search": ("no_shard", "optim"), "on": ("optim",), "off": ("no_shard",)}[
            args.distributed_optimizer
        ]
    if args.sharding in (None, "search"):
        return tuple(SHARDING)
    return _names(args.sharding, tuple(SHARDING), "--sharding", parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = _model(args, parser)
    published = {run.name: run for run in MEGATRON_WEAK_SCALING}.get(args.model_preset)
    global_batch = args.global_batch_size or published_batch(args.model_preset)
    if global_batch is None:
        parser.error("--global-batch-size is required (a --model-preset brings its paper's)")
    cluster = PRESETS[args.cluster]
    nodes = args.nodes or (published.gpus // cluster.gpus_per_node if published else 1)
    changes = {"nodes": nodes}
    for field, value in (
        ("gpus_per_node", args.gpus_per_node),
        ("memory_bytes", args.gpu_memory_gib * GIB if args.gpu_memory_gib else None),
        ("peak_tflops", args.peak_tflops),
        ("intra_node_gbps", args.intra_node_gbps),
        ("inter_node_gbps", args.inter_node_gbps),
        ("matmul_efficiency", args.matmul_efficiency),
        ("collective_latency_us", args.collective_latency_us),
        ("memory_gbps", args.memory_gbps),
        ("shard_collective_efficiency", args.shard_collective_efficiency),
    ):
        if value is not None:
            changes[field] = value
    cluster = cluster.with_(**changes)
    if cluster.matmul_efficiency <= 0:
        parser.error("--matmul-efficiency must be above 0")
    if args.memory_fraction <= 0:
        parser.error("--memory-fraction must be above 0")
    options = PlanOptions(
        micro_batches=args.micro_batch_sizes,
        recompute=_names(args.recompute, tuple(RECOMPUTE_MODES), "--recompute", parser),
        sharding=_sharding(args, parser),
        schedules=_names(args.schedules, SCHEDULE_KINDS, "--schedules", parser)
        if args.schedules
        else None,
        max_vp=args.max_vp,
        allow_cross_node_tp=args.allow_cross_node_tp,
        memory_fraction=args.memory_fraction,
        sequence_parallel=args.sequence_parallel,
        context_parallel=args.context_parallel_sizes,
        cp_comm_types=_names(args.cp_comm_types, COMM_TYPES, "--cp-comm-types", parser),
        expert_parallel=args.expert_model_parallel_sizes,
        moe_dispatchers=_names(args.moe_dispatchers, DISPATCHERS, "--moe-dispatchers", parser),
        knobs=TimeKnobs(
            args.tp_overlap,
            args.dp_overlap,
            param_gather_overlap=args.param_gather_overlap,
            half_precision=not args.fp32,
            tp_weight_grad_overlap=not args.no_async_tensor_model_parallel_allreduce,
            cp_overlap=not args.no_cp_overlap,
        ),
    )
    if model.moe is None and args.expert_model_parallel_sizes is not None:
        parser.error("--expert-model-parallel-sizes needs a mixture of experts (--num-experts)")
    result = plan(model, cluster, global_batch, options)
    print(format_plan(result, top=args.top, explain=args.explain, show_rejected=args.show_rejected))
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
