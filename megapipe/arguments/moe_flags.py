"""Mixture-of-experts flags (Megatron-LM's --num-experts family) -> MoEConfig, and the
combinations megapipe refuses with MoE for now (each in one line naming flags and numbers)."""

from __future__ import annotations

import argparse
import ast

from megapipe.config import (
    MOE_DISPATCHERS,
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING_TYPES,
    MOE_SCORE_FUNCTIONS,
    CheckpointConfig,
    KernelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
)
from megapipe.errors import ConfigError


def add_moe_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--num-experts", type=int, default=None, help="Number of experts (None: no MoE).")
    add(
        "--moe-layer-freq",
        default="1",
        help="Which layers hold an MoE: an int N (every N-th layer, from layer 0) or a list "
        "such as [1,0,1,0] with one entry per layer. Default: 1 (every layer).",
    )
    add("--moe-ffn-hidden-size", type=int, default=None, help="Each expert's ffn hidden size.")
    add("--moe-router-topk", type=int, default=2, help="Experts per token. Default: 2.")
    add(
        "--moe-router-score-function",
        default="softmax",
        choices=MOE_SCORE_FUNCTIONS,
        help="Router score function. Default: softmax.",
    )
    add(
        "--moe-router-pre-softmax",
        action="store_true",
        help="Softmax over all experts before top-k (default: top-k of the logits, then "
        "softmax over the chosen ones, as Mixtral).",
    )
    add(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="Multiply the chosen experts' routing probabilities by this factor.",
    )
    add(
        "--moe-router-load-balancing-type",
        default="aux_loss",
        choices=MOE_LOAD_BALANCING_TYPES,
        help="aux_loss (Switch Transformer, over the micro-batch), seq_aux_loss (per "
        "sequence) or none. Default: aux_loss.",
    )
    add("--moe-aux-loss-coeff", type=float, default=0.0, help="Load-balancing loss coefficient.")
    add("--moe-z-loss-coeff", type=float, default=None, help="Router z-loss coefficient.")
    add(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="DeepSeek-V3's aux-loss-free balancing: a bias on the scores, for selection only, "
        "moved toward balance after every step (needs --moe-router-score-function sigmoid).",
    )
    add(
        "--moe-router-bias-update-rate",
        type=float,
        default=1e-3,
        help="Step of the expert bias update. Default: 1e-3.",
    )
    add(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="ffn size of a shared (dense) expert that every token also goes through.",
    )
    add(
        "--moe-grouped-gemm",
        action="store_true",
        help="All experts' GEMMs in one grouped matmul (torch's grouped_mm, else a loop).",
    )
    add(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="Each expert takes at most ceil(tokens x topk / experts x factor) tokens of a "
        "micro-batch; the rest are dropped (None: dropless).",
    )
    add(
        "--moe-token-drop-policy",
        default="probs",
        choices=MOE_DROP_POLICIES,
        help="Over capacity, drop the lowest-probability (probs) or the latest (position) "
        "tokens. Default: probs.",
    )
    add(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="Give every expert exactly its capacity of tokens (padding with zero weight).",
    )
    add(
        "--moe-token-dispatcher-type",
        default="allgather",
        choices=MOE_DISPATCHERS,
        help="How tokens reach experts on other expert-parallel ranks: alltoall (each "
        "rank's rows to the experts' ranks and back) or allgather (every rank gathers the "
        "EP group's tokens; a reduce-scatter returns the outputs). Same numbers; at EP 1 "
        "both are a local sort. Default: allgather.",
    )
    add(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="TP size of the experts; only the default (= --tensor-model-parallel-size).",
    )


def _layer_freq(text: str, num_layers: int) -> int | tuple[int, ...]:
    """--moe-layer-freq: an int, or a Python-style list of 0/1 with one entry per layer."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, list) and all(v in (0, 1) for v in value):
        if len(value) != num_layers:
            raise ConfigError(
                f"--moe-layer-freq {text}: {len(value)} entries for --num-layers {num_layers}"
            )
        return tuple(int(v) for v in value)
    raise ConfigError(f"--moe-layer-freq {text}: expected an int >= 1 or a list of 0/1")


def moe_config(args: argparse.Namespace) -> MoEConfig | None:
    """The MoE flags as a MoEConfig (None without --num-experts); ConfigError for a bad one."""
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != tp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp}: experts are split like the dense MLP, so "
            f"only --tensor-model-parallel-size ({tp}) is supported yet"
        )
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} needs --num-experts (experts to split)"
            )
        return None
    e, k = args.num_experts, args.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts {e}: must be at least 1")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk {k}: must be between 1 and --num-experts {e}")
    if ep < 1 or e % ep:
        raise ConfigError(
            f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}: each "
            "expert-parallel rank holds the same number of experts"
        )
    factor = args.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor {factor}: must be > 0")
    if args.moe_pad_expert_input_to_capacity and factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (it is "
            f"{args.moe_router_score_function}), as Megatron-Core"
        )
    if args.moe_router_pre_softmax and args.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    if k == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax:
        raise ConfigError(
            "--moe-router-topk 1 with softmax routing needs --moe-router-pre-softmax (a softmax "
            "over the one chosen expert is always 1, so the router would get no gradient), as "
            "Megatron-Core"
        )
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be positive")
    if args.moe_aux_loss_coeff < 0 or (args.moe_z_loss_coeff or 0) < 0:
        raise ConfigError(
            f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} / --moe-z-loss-coeff "
            f"{args.moe_z_loss_coeff}: must not be negative"
        )
    return MoEConfig(
        num_experts=e,
        moe_layer_freq=_layer_freq(args.moe_layer_freq, args.num_layers),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=k,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_expert_capacity_factor=factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
    )


def validate_moe_features(
    moe: MoEConfig | None,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    kernels: KernelConfig,
    checkpoint: CheckpointConfig,
    optimizer: OptimizerConfig,
    world_size: int,
) -> None:
    """MoE with a feature it does not work with yet, or an expert-parallel size that does not
    fit the layout: one line naming the flags and numbers."""
    if moe is None:
        return
    e = moe.num_experts
    ep = parallel.expert_model_parallel_size
    if ep > 1:
        cp = parallel.context_parallel_size
        dp_cp = parallel.data_parallel_size(world_size) * cp
        if dp_cp % ep:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} does not divide data-parallel x "
                f"context-parallel size {dp_cp} (world {world_size} / (TP "
                f"{parallel.tensor_model_parallel_size} x PP "
                f"{parallel.pipeline_model_parallel_size})): EP ranks are taken from DP x CP"
            )
        if checkpoint.save is not None and checkpoint.ckpt_format == "torch":
            raise ConfigError(
                f"--expert-model-parallel-size {ep} with --ckpt-format torch: the legacy format "
                "is written per (TP, PP) rank and would lose the other EP ranks' experts; use "
                "--ckpt-format torch_dist"
            )
        sharding = optimizer.data_parallel_sharding_strategy
        if sharding in ("optim_grads", "optim_grads_params") and dp_cp == ep:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} equal to data-parallel x context-parallel "
                f"size with ZeRO-2/3 (--use-torch-fsdp2 or --data-parallel-sharding-strategy "
                f"{sharding}): no two ranks hold the same experts to shard them over; use "
                "--use-distributed-optimizer, or a smaller EP"
            )
        if optimizer.num_distributed_optimizer_instances > 1:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} with --num-distributed-optimizer-instances "
                f"{optimizer.num_distributed_optimizer_instances}: not supported yet"
            )
    cp = parallel.context_parallel_size
    if cp > 1 and moe.moe_expert_capacity_factor is not None:
        raise ConfigError(
            f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor} with "
            f"--context-parallel-size {cp}: an expert's capacity is taken over the whole "
            "micro-batch, which no CP rank holds; drop the capacity factor (dropless) under CP"
        )
    if recompute.full or recompute.selective("mlp"):
        raise ConfigError(
            f"--num-experts {e} with --recompute-granularity {recompute.describe()}: "
            "recomputing an MoE layer is not supported yet"
        )
    if kernels.transformer_impl != "local":
        raise ConfigError(
            f"--num-experts {e} with --transformer-impl {kernels.transformer_impl}: MoE "
            "layers are local only yet"
        )
