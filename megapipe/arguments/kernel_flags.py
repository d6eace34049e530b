"""Megatron's kernel flags: --attention-backend, --use-flash-attn, --transformer-impl and the
fusion switches, as a KernelConfig."""

from __future__ import annotations

import argparse
import importlib.util

from megapipe.config import KernelConfig
from megapipe.errors import ConfigError
from megapipe.model.attention_backends import ATTENTION_BACKENDS

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
    for name, field, value in FUSION_SWITCHES:
        what = name.removeprefix("--no-").removeprefix("--").replace("-", " ")
        help_text = f"Use the fused {what} kernel." if value else f"Do not fuse {what}."
        group.add_argument(name, dest=field, action="store_const", const=value,
                           default=not value, help=help_text)  # fmt: skip


def kernel_config(args: argparse.Namespace) -> KernelConfig:
    """The kernel flags as a KernelConfig; ConfigError for a forced implementation that is
    missing here (TransformerEngine) or contradictory backend flags."""
    backend = args.attention_backend
    if args.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn contradicts --attention-backend {backend}")
        backend = "flash"
    if args.transformer_impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "--transformer-impl transformer_engine: TransformerEngine is not installed "
                "(it needs CUDA: pip install transformer_engine[pytorch]); use --transformer-impl "
                "local"
            )
        raise ConfigError(
            "--transformer-impl transformer_engine: megapipe does not drive TransformerEngine's "
            "layers yet; use --transformer-impl local"
        )
    switches = {field: getattr(args, field) for _, field, _ in FUSION_SWITCHES}
    return KernelConfig(attention_backend=backend, transformer_impl=args.transformer_impl,
                        **switches)  # fmt: skip
