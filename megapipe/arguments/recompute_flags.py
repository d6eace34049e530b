"""Megatron's activation-recomputation flags and the RecomputeConfig they make."""

from __future__ import annotations

import argparse

from megapipe.config import RECOMPUTE_MODULES, RecomputeConfig
from megapipe.errors import ConfigError

# Megatron-Core's other module names: known, refused by name rather than as typos.
MEGATRON_ONLY_MODULES = ("moe_act", "layernorm", "mla_up_proj", "moe", "shared_experts")


def add_recompute_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="full: recompute whole transformer layers (see --recompute-method); selective: "
        "recompute only --recompute-modules inside each layer.",
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron's older name for --recompute-granularity selective.",
    )
    group.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="With full recomputation: uniform recomputes groups of --recompute-num-layers "
        "layers (only each group's input is kept); block recomputes the first "
        "--recompute-num-layers layers of each pipeline stage.",
    )
    group.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="Layers per recomputed group (uniform) or recomputed layers per stage (block).",
    )
    group.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        help=f"With selective recomputation: any of {', '.join(RECOMPUTE_MODULES)} "
        "(default: core_attn).",
    )


def recompute_config(args: argparse.Namespace) -> RecomputeConfig:
    """The recomputation flags as a RecomputeConfig; ConfigError for a combination Megatron
    refuses too (a method without full, full without a method or layer count, ...)."""
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ConfigError(
                "--recompute-activations (selective) and --recompute-granularity full: pick one"
            )
        granularity = "selective"
    method, layers = args.recompute_method, args.recompute_num_layers
    if granularity != "full":
        if method is not None:
            raise ConfigError(
                f"--recompute-method {method} needs --recompute-granularity full (it is "
                f"{granularity or 'not set'})"
            )
        if layers is not None:
            raise ConfigError(
                f"--recompute-num-layers {layers} needs --recompute-granularity full (it is "
                f"{granularity or 'not set'})"
            )
    else:
        if method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method uniform|block")
        if layers is None:
            raise ConfigError("--recompute-granularity full needs --recompute-num-layers N")
        if layers < 1:
            raise ConfigError(f"--recompute-num-layers {layers}: must be at least 1")
    modules = tuple(args.recompute_modules) if args.recompute_modules is not None else None
    if modules is not None:
        if granularity != "selective":
            raise ConfigError(
                "--recompute-modules needs --recompute-granularity selective (it is "
                f"{granularity or 'not set'})"
            )
        for name in modules:
            if name in MEGATRON_ONLY_MODULES:
                raise ConfigError(
                    f"--recompute-modules {name}: megapipe recomputes only "
                    f"{', '.join(RECOMPUTE_MODULES)}"
                )
            if name not in RECOMPUTE_MODULES:
                raise ConfigError(
                    f"--recompute-modules {name}: unknown module; choose from "
                    f"{', '.join(RECOMPUTE_MODULES)}"
                )
        if not modules:
            raise ConfigError("--recompute-modules: name at least one module")
    return RecomputeConfig(granularity, method, layers, modules or ("core_attn",))
