"""Flags that describe the network: sizes, attention, positions, norms, init, dropout."""

from __future__ import annotations

import argparse


def add_network_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--num-layers", type=int, required=True, help="Number of transformer layers."
    )
    group.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Transformer feed-forward network hidden size. Default: 4 x hidden size, or "
        "int(8 x hidden size / 3 / 64) x 64 with --swiglu (as Megatron-LM).",
    )
    group.add_argument(
        "--num-attention-heads", type=int, required=True, help="Number of attention heads."
    )
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (keys and values shared by --num-query-groups groups).",
    )
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Number of query groups; only takes effect with --group-query-attention. "
        "Default with it: 1 (multi-query attention), as Megatron-LM.",
    )
    group.add_argument(
        "--seq-length", type=int, required=True, help="Maximum sequence length to process."
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Maximum number of position embeddings. Default: --seq-length.",
    )
    group.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        help="Position embedding type: learned_absolute, rope or none. Default: learned_absolute.",
    )
    group.add_argument(
        "--rotary-base", type=int, default=10000, help="Base of rotary embeddings. Default: 10000."
    )
    group.add_argument(
        "--normalization",
        default="LayerNorm",
        help="Normalization layer: LayerNorm or RMSNorm. Default: LayerNorm.",
    )
    group.add_argument(
        "--layernorm-epsilon", type=float, default=1e-5, help="Norm epsilon. Default: 1e-5."
    )
    group.add_argument(
        "--swiglu", action="store_true", help="Use gated linear units and SiLU activation (SwiGLU)."
    )
    group.add_argument(
        "--openai-gelu",
        action="store_true",
        help="Use OpenAI's GeLU (GPT-2's tanh approximation) instead of the exact erf GeLU.",
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Untie the input word embedding and the output layer weights.",
    )
    group.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="Disable bias in the linear layers.",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocab size to be divisible by this value (times the tensor-model-parallel "
        "size), for computation efficiency. Default: 128.",
    )
    group.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Standard deviation of the zero-mean normal weight initialisation. Default: 0.02.",
    )


def add_regularization_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="Dropout probability on the attention weights. Default: 0.1.",
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout probability on the hidden states (after attention and MLP). Default: 0.1.",
    )
