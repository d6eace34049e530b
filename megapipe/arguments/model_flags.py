"""Flags that describe the network: sizes, attention, positions, norms, init, dropout."""

from __future__ import annotations

import argparse

from megapipe.errors import ConfigError


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
        "--kv-channels",
        type=int,
        default=None,
        help="Projection weights dimension in multi-head attention (the head dimension of Q, "
        "K and V). Default: --hidden-size / --num-attention-heads.",
    )
    group.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Apply a norm (of --normalization's type) over each head of the queries and keys "
        "after the QKV projection, before rotary embeddings.",
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
        default=None,
        help="Position embedding type: learned_absolute, rope or none. Default: learned_absolute.",
    )
    group.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Use rotary positional embeddings (Megatron-LM's older spelling of "
        "--position-embedding-type rope).",
    )
    group.add_argument(
        "--rotary-base", type=int, default=10000, help="Base of rotary embeddings. Default: 10000."
    )
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's dimensions that rotary embeddings rotate (the first "
        "int(kv-channels x percent)); the rest pass through unchanged. Default: 1.0.",
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
        "--squared-relu",
        action="store_true",
        help="Use squared ReLU (relu(x)^2) as the MLP activation instead of GeLU.",
    )
    group.add_argument(
        "--apply-residual-connection-post-layernorm",
        action="store_true",
        help="Take each residual connection from the output of the norm before the attention "
        "(MLP) block instead of from its input (the original BERT ordering).",
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


def resolve_position_embedding(args: argparse.Namespace) -> None:
    """Settle --position-embedding-type in `args` (recorded as settled): rope with
    --use-rotary-position-embeddings, else the flag's value or learned_absolute."""
    given = args.position_embedding_type
    if args.use_rotary_position_embeddings:
        if given not in (None, "rope"):
            raise ConfigError(
                f"--use-rotary-position-embeddings contradicts --position-embedding-type {given} "
                "(it means --position-embedding-type rope)"
            )
        args.position_embedding_type = "rope"
    elif given is None:
        args.position_embedding_type = "learned_absolute"
