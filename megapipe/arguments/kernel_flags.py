"""Megatron's kernel flags: --attention-backend, --use-flash-attn, --transformer-impl, the
fusion switches and FP8's --fp8-* flags, and megapipe's --attention-dropout-rng, as a
KernelConfig.

What can be checked before the device exists is checked here (TE installed, a CUDA device,
--fp8-format only with TE); the FP8 compute-capability check needs the device and runs when
the kernels are chosen (kernels/dispatch.py), through the same pure function."""

from __future__ import annotations

import argparse
import importlib.util

import torch

from megapipe.arguments.parallel_flags import cp_comm_type, nccl_emulation_rules
from megapipe.config import KernelConfig
from megapipe.errors import ConfigError
from megapipe.kernels.availability import Probe
from megapipe.kernels.transformer_engine import (
    FP8_AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    check_fp8_recipe,
    check_transformer_engine,
)
from megapipe.model.attention_backends import ATTENTION_BACKENDS, ATTENTION_DROPOUT_RNGS

# (flag, KernelConfig field, the switch's meaning when given)
FUSION_SWITCHES = (
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", False),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", False),
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-rope-fusion", "rope_fusion", False),
    ("--no-persist-layer-norm", "persist_layer_norm", False),
    ("--cross-entropy-loss-fusion", "cross_entropy_loss_fusion", True),
)
FUSION_HELP = {
    "--no-bias-gelu-fusion": "Add the MLP bias and apply GeLU as two ops, not one fused kernel.",
    "--no-bias-dropout-fusion": "Bias, dropout and residual add as separate ops, not fused.",
    "--no-bias-swiglu-fusion": "Add the MLP bias and apply SwiGLU as separate ops, not fused.",
    "--no-masked-softmax-fusion": "Mask, scale and softmax the attention scores unfused.",
    "--no-rope-fusion": "Apply rotary position embeddings without the fused kernel.",
    "--no-persist-layer-norm": "Do not use the persistent LayerNorm kernel (apex).",
    "--cross-entropy-loss-fusion": "Compute the cross-entropy loss with the fused kernel.",
}


def add_kernel_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto: scaled_dot_product_attention picks its backend; flash / fused: force SDPA's "
        "FlashAttention / memory-efficient backend (flash also uses the flash_attn package when "
        "installed); unfused / local: softmax(QK^T)V written out. Default: auto.",
    )
    group.add_argument(
        "--attention-dropout-rng",
        choices=ATTENTION_DROPOUT_RNGS,
        default="auto",
        help="Where attention dropout's mask comes from. fused: the attention kernel draws it "
        "(SDPA's / flash_attn's dropout_p) from the tensor-parallel RNG stream, as Megatron "
        "does: flash attention stays on and TP ranks draw different masks for their heads; "
        "reproducible for a seed and layout, but another TP/PP/DP layout draws other masks. "
        "layout-invariant: masks keyed by (seed, sample, layer, site), so any layout trains "
        "exactly as one rank does, at the price of the unfused attention ([b, heads, s, s] "
        "probabilities; every TP rank draws all heads' masks). Default auto: fused on CUDA, "
        "layout-invariant on CPU (where parity is tested and SDPA has no fused dropout).",
    )
    group.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="Megatron's older switch for --attention-backend flash.",
    )
    group.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="local: megapipe's layers (with its fused kernels where they run); "
        "transformer_engine: NVIDIA TransformerEngine's layers. Default: local.",
    )
    group.add_argument(
        "--fp8-format",
        choices=FP8_FORMATS,
        default=None,
        help="FP8 GEMMs through TransformerEngine (needs --transformer-impl transformer_engine "
        "and a GPU of compute capability >= 8.9): hybrid = E4M3 forward, E5M2 gradients; "
        "e4m3 = E4M3 everywhere. Default: no FP8.",
    )
    group.add_argument(
        "--fp8-margin",
        type=int,
        default=0,
        help="Scaling-factor margin of FP8's delayed scaling. Default: 0.",
    )
    group.add_argument(
        "--fp8-amax-history-len",
        type=int,
        default=1024,
        help="Length of the amax history window of FP8's delayed scaling. Default: 1024.",
    )
    group.add_argument(
        "--fp8-amax-compute-algo",
        choices=FP8_AMAX_COMPUTE_ALGOS,
        default="max",
        help="How the scale comes from the amax history. Default: max.",
    )
    for name, field, value in FUSION_SWITCHES:
        group.add_argument(name, dest=field, action="store_const", const=value,
                           default=not value, help=FUSION_HELP[name])  # fmt: skip


def kernel_config(args: argparse.Namespace) -> KernelConfig:
    """The kernel flags as a KernelConfig; ConfigError for a forced implementation that is
    missing here (TransformerEngine, a CUDA device), FP8 without TransformerEngine, FP8
    with recomputation, or contradictory backend flags."""
    backend = args.attention_backend
    if args.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn contradicts --attention-backend {backend}")
        backend = "flash"
    if args.transformer_impl == "transformer_engine" and (
        importlib.util.find_spec("transformer_engine") is None
    ):
        raise ConfigError(
            "--transformer-impl transformer_engine: TransformerEngine is not installed "
            "(it needs CUDA: pip install transformer_engine[pytorch]); use --transformer-impl "
            "local"
        )
    check_transformer_engine(
        args.transformer_impl,
        args.fp8_format,
        te=Probe(True, "installed"),  # importable is checked when the kernels are chosen
        device_type="cuda" if torch.cuda.is_available() else "cpu",
        capability=None,  # the device is not chosen yet: checked when the kernels are
    )
    check_fp8_recipe(args.fp8_margin, args.fp8_amax_history_len, args.fp8_amax_compute_algo)
    recomputing = getattr(args, "recompute_granularity", None) or (
        "selective" if getattr(args, "recompute_activations", False) else None
    )
    if args.fp8_format is not None and recomputing:
        raise ConfigError(
            f"--fp8-format with --recompute-granularity {recomputing}: megapipe's recomputation "
            "would run the FP8 layers' forward twice and update their amax history twice; "
            "drop one of them"
        )
    switches = {field: getattr(args, field) for _, field, _ in FUSION_SWITCHES}
    fp8 = {
        name: getattr(args, name)
        for name in ("fp8_format", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
    }
    cp = {"cp_comm_type": cp_comm_type(args)} if hasattr(args, "cp_comm_type") else {}
    if getattr(args, "emulate_nccl_p2p_order", None) is not None:
        cp["emulate_nccl_p2p_order"] = nccl_emulation_rules(args.emulate_nccl_p2p_order)
    return KernelConfig(attention_backend=backend, transformer_impl=args.transformer_impl,
                        attention_dropout_rng=args.attention_dropout_rng,
                        **switches, **fp8, **cp)  # fmt: skip
