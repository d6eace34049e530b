"""Sharded data parallelism's flags, in Megatron-LM's spellings, resolved to one strategy.

Two spellings reach the same implementation (`OptimizerConfig.sharding`):

| Megatron-LM flags                                               | strategy           | ZeRO |
|-----------------------------------------------------------------|--------------------|------|
| (none)                                                          | no_shard           | DDP  |
| --use-distributed-optimizer                                     | optim              | 1    |
| --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads | optim_grads      | 2    |
| --use-torch-fsdp2, or ... optim_grads_params                    | optim_grads_params | 3    |

`no_shard` and `optim` are megapipe's own bucketed DDP and distributed optimizer; the two
others run on torch's FSDP2 (distributed/fsdp.py). Hybrid sharding is
--num-distributed-optimizer-instances N with --outer-dp-sharding-strategy no_shard: shard
inside N groups of consecutive data-parallel ranks, replicate across them (with `optim`,
Megatron-LM's partial distributed optimizer: the gradient buckets are reduce-scattered inside
the instance and the shards all-reduced across instances).
"""

from __future__ import annotations

import argparse

from megapipe.errors import ConfigError

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER_STRATEGIES = ("no_shard", "optim")


def add_sharding_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard parameters, gradients and optimizer state over the data-parallel ranks "
        "(ZeRO-3) with torch's FSDP2; the same as --use-megatron-fsdp "
        "--data-parallel-sharding-strategy optim_grads_params.",
    )
    add(
        "--use-megatron-fsdp",
        action="store_true",
        help="Sharded data parallelism with the strategy --data-parallel-sharding-strategy "
        "names (megapipe runs it on torch's FSDP2 or its own distributed optimizer).",
    )
    add(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        default=None,
        help="With --use-megatron-fsdp: no_shard (plain data parallelism), optim (optimizer "
        "state: ZeRO-1, the distributed optimizer), optim_grads (and gradients: ZeRO-2), "
        "optim_grads_params (and parameters: ZeRO-3). Default: no_shard.",
    )
    add(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Hybrid sharding: shard inside this many groups of consecutive data-parallel "
        "ranks (one node's NVLink domain each) and replicate across them. Default: 1.",
    )
    add(
        "--outer-dp-sharding-strategy",
        choices=OUTER_STRATEGIES,
        default="no_shard",
        help="With --num-distributed-optimizer-instances > 1: no_shard replicates across the "
        "groups (the only one megapipe runs; optim is refused by name). Default: no_shard.",
    )


def resolve_sharding(args: argparse.Namespace) -> None:
    """Settle the spellings into args.data_parallel_sharding_strategy and
    args.use_distributed_optimizer (ZeRO-1), or raise ConfigError naming the flags."""
    strategy = args.data_parallel_sharding_strategy
    if args.use_torch_fsdp2 and args.use_megatron_fsdp:
        raise ConfigError(
            "--use-torch-fsdp2 and --use-megatron-fsdp are two spellings of sharded data "
            "parallelism: pass one (--use-torch-fsdp2 is --use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads_params)"
        )
    if args.use_torch_fsdp2:
        if strategy not in (None, "optim_grads_params"):
            raise ConfigError(
                f"--use-torch-fsdp2 shards parameters (optim_grads_params); "
                f"--data-parallel-sharding-strategy {strategy} contradicts it: use "
                f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} instead"
            )
        strategy = "optim_grads_params"
    elif strategy is not None and not args.use_megatron_fsdp:
        raise ConfigError(
            f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp (or "
            "--use-torch-fsdp2 for optim_grads_params; --use-distributed-optimizer for optim)"
        )
    strategy = strategy or "no_shard"
    if strategy in ("optim_grads", "optim_grads_params") and args.ckpt_format == "torch":
        raise ConfigError(
            f"--ckpt-format torch (the legacy per-rank layout) cannot hold {strategy}'s "
            "sharded parameters and gradients; use --ckpt-format torch_dist, which loads "
            "under any sharding strategy and layout"
        )
    if strategy == "no_shard" and args.use_distributed_optimizer:
        if args.data_parallel_sharding_strategy == "no_shard":
            raise ConfigError(
                "--use-distributed-optimizer shards the optimizer state, "
                "--data-parallel-sharding-strategy no_shard shards nothing: pass one"
            )
        strategy = "optim"
    args.use_distributed_optimizer = strategy == "optim"  # FSDP2 shards the optimizer itself
    args.data_parallel_sharding_strategy = strategy
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be >= 1, got {instances}")
    if instances > 1 and strategy == "no_shard":
        raise ConfigError(
            f"--num-distributed-optimizer-instances {instances}: hybrid sharding needs a "
            "sharded strategy (--use-distributed-optimizer, --use-torch-fsdp2, or "
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim|optim_grads|"
            "optim_grads_params); this run shards nothing"
        )
    if args.outer_dp_sharding_strategy != "no_shard":
        raise ConfigError(
            f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: megapipe "
            "replicates across the --num-distributed-optimizer-instances groups (no_shard); "
            "sharding the optimizer across them too is not supported"
        )


def hybrid_groups(data_parallel_size: int, instances: int) -> str | None:
    """Why `instances` cannot split `data_parallel_size` ranks into equal groups, or None."""
    if data_parallel_size % instances:
        return (
            f"--num-distributed-optimizer-instances ({instances}) does not divide the "
            f"data-parallel size ({data_parallel_size})"
        )
    return None
