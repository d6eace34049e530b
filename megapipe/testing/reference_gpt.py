"""A plain-PyTorch GPT of megapipe's math: the golden reference for tests and benchmarks.

`PlainGPT` is written with torch.nn modules only (no megapipe imports, no parallelism): token
(+ learned position) embeddings, pre-norm blocks (LayerNorm or RMSNorm; fused QKV in Megatron's
per-query-group layout; causal scaled_dot_product_attention, optionally GQA and rotary in the
rotate-half form; GeLU (exact, or GPT-2's tanh approximation) or SwiGLU MLP), a final norm, an
output layer tied to the word embedding or not, and cross-entropy. Activations are [s, b, h] as
in megapipe. Megatron-LM's model-shape flags too: a head size other than hidden/heads
(--kv-channels), per-head query/key norms (--qk-layernorm), rotary on the leading part of each
head (--rotary-percent), a squared-ReLU MLP (--squared-relu) and residuals taken after the
norms (--apply-residual-connection-post-layernorm).

`reference_from_megapipe` builds the plain model for a single-rank megapipe `GPTModel` and
copies its weights in by name, so both start from the same point: a test can then train the
plain model with torch.optim and compare megapipe's training against it, and the overhead
benchmark can time the two on the same math.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from megapipe.model.gpt import GPTModel


def rotate_half(x: torch.Tensor, base: float, percent: float = 1.0) -> torch.Tensor:
    """Rotary position embedding of x [s, b, heads, d] at positions 0..s-1 (rotate-half form).

    Only the first r = int(d * percent) dims of each head rotate; of those, the pair
    (x_i, x_{i + r/2}) is rotated by the angle position * base^(-2i/r), the rest kept as is.
    """
    r = int(x.shape[-1] * percent)
    if r < x.shape[-1]:
        return torch.cat([rotate_half(x[..., :r], base), x[..., r:]], dim=-1)
    s, d = x.shape[0], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq  # [s, d/2]
    cos = angles.cos().to(x.dtype)[:, None, None, :]
    sin = angles.sin().to(x.dtype)[:, None, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _norm(rmsnorm: bool, hidden: int, eps: float) -> nn.Module:
    return nn.RMSNorm(hidden, eps=eps) if rmsnorm else nn.LayerNorm(hidden, eps=eps)


class PlainBlock(nn.Module):
    """x + drop(proj(attn(ln1(x)))), then x + drop(fc2(act(fc1(ln2(x)))))."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        dropout: float,
        eps: float,
        *,
        ffn_hidden: int | None = None,
        query_groups: int | None = None,
        rope_base: float | None = None,
        rmsnorm: bool = False,
        swiglu: bool = False,
        openai_gelu: bool = False,
        bias: bool = True,
        head_dim: int | None = None,
        qk_norm: bool = False,
        rope_percent: float = 1.0,
        squared_relu: bool = False,
        residual_after_norm: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, head_dim or hidden // heads, dropout
        self.groups = query_groups or heads
        self.rope_base, self.swiglu, self.openai_gelu = rope_base, swiglu, openai_gelu
        self.rope_percent, self.squared_relu = rope_percent, squared_relu
        self.residual_after_norm = residual_after_norm
        ffn_hidden = ffn_hidden or 4 * hidden
        self.ln1 = _norm(rmsnorm, hidden, eps)
        # Output features grouped per query group: [q_0 .. q_{k-1}, k, v] (Megatron's layout).
        self.qkv = nn.Linear(hidden, self.head_dim * (heads + 2 * self.groups), bias=bias)
        self.q_norm = _norm(rmsnorm, self.head_dim, eps) if qk_norm else None
        self.k_norm = _norm(rmsnorm, self.head_dim, eps) if qk_norm else None
        self.proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.ln2 = _norm(rmsnorm, hidden, eps)
        self.fc1 = nn.Linear(hidden, ffn_hidden * (2 if swiglu else 1), bias=bias)  # [gate; up]
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        per_group = self.heads // self.groups
        n1 = self.ln1(x)
        qkv = self.qkv(n1).view(s, b, self.groups, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(s, b, self.heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.q_norm is not None:  # over each head's head_dim values
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_base is not None:
            q = rotate_half(q, self.rope_base, self.rope_percent)
            k = rotate_half(k, self.rope_base, self.rope_percent)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or groups, s, d]
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.groups != self.heads
        )
        a = a.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        x = (n1 if self.residual_after_norm else x) + F.dropout(self.proj(a), p, self.training)
        n2 = self.ln2(x)
        if self.residual_after_norm:
            x = n2
        y = self.fc1(n2)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.squared_relu:
            y = y.clamp(min=0) * y.clamp(min=0)
        elif self.openai_gelu:  # written out, not F.gelu(approximate="tanh"): a reference
            y = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)))
        else:
            y = F.gelu(y)
        return x + F.dropout(self.fc2(y), p, self.training)


class PlainGPT(nn.Module):
    """A decoder-only GPT over [s, b, h] activations.

    Defaults are GPT-2's shape (learned positions, LayerNorm, GeLU MLP of 4h, biases, tied
    output layer); the keywords select the Llama-style parts.
    """

    def __init__(
        self,
        layers: int,
        hidden: int,
        heads: int,
        vocab: int,
        seq: int,
        dropout: float,
        eps: float = 1e-5,
        std: float = 0.02,
        *,
        ffn_hidden: int | None = None,
        query_groups: int | None = None,
        rope_base: float | None = None,
        rmsnorm: bool = False,
        swiglu: bool = False,
        openai_gelu: bool = False,
        tied: bool = True,
        bias: bool = True,
        head_dim: int | None = None,
        qk_norm: bool = False,
        rope_percent: float = 1.0,
        squared_relu: bool = False,
        residual_after_norm: bool = False,
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden) if rope_base is None else None
        block = dict(
            ffn_hidden=ffn_hidden,
            query_groups=query_groups,
            rope_base=rope_base,
            rmsnorm=rmsnorm,
            swiglu=swiglu,
            openai_gelu=openai_gelu,
            bias=bias,
            head_dim=head_dim,
            qk_norm=qk_norm,
            rope_percent=rope_percent,
            squared_relu=squared_relu,
            residual_after_norm=residual_after_norm,
        )
        self.blocks = nn.ModuleList(
            PlainBlock(hidden, heads, dropout, eps, **block) for _ in range(layers)
        )
        self.ln_f = _norm(rmsnorm, hidden, eps)
        self.lm_head = None if tied else nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2.0 * layers))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels: [b, s]; returns the per-token loss [b, s]."""
        s = tokens.shape[1]
        x = self.wte(tokens.t())  # [s, b, h]
        if self.wpe is not None:
            x = x + self.wpe.weight[:s, None]
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        output_weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.ln_f(x), output_weight)  # [s, b, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none")
        return loss.view(s, -1).t()


# megapipe parameter name -> plain parameter name (per layer).
_LAYER_NAMES = {
    "input_layernorm.weight": "ln1.weight",
    "input_layernorm.bias": "ln1.bias",
    "self_attention.linear_qkv.weight": "qkv.weight",
    "self_attention.linear_qkv.bias": "qkv.bias",
    "self_attention.linear_proj.weight": "proj.weight",
    "self_attention.linear_proj.bias": "proj.bias",
    "self_attention.q_layernorm.weight": "q_norm.weight",
    "self_attention.q_layernorm.bias": "q_norm.bias",
    "self_attention.k_layernorm.weight": "k_norm.weight",
    "self_attention.k_layernorm.bias": "k_norm.bias",
    "pre_mlp_layernorm.weight": "ln2.weight",
    "pre_mlp_layernorm.bias": "ln2.bias",
    "mlp.linear_fc1.weight": "fc1.weight",
    "mlp.linear_fc1.bias": "fc1.bias",
    "mlp.linear_fc2.weight": "fc2.weight",
    "mlp.linear_fc2.bias": "fc2.bias",
}
_FIXED_NAMES = {
    "embedding.word_embeddings.weight": "wte.weight",
    "embedding.position_embeddings.weight": "wpe.weight",
    "decoder.final_layernorm.weight": "ln_f.weight",
    "decoder.final_layernorm.bias": "ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}


def plain_name(name: str) -> str:
    """The PlainGPT parameter that corresponds to megapipe's global parameter `name`."""
    if name in _FIXED_NAMES:
        return _FIXED_NAMES[name]
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        raise KeyError(name)
    index, rest = name[len(prefix) :].split(".", 1)
    return f"blocks.{index}.{_LAYER_NAMES[rest]}"


@torch.no_grad()
def copy_weights(src: nn.Module, dst: PlainGPT) -> None:
    """Give the plain model a single-rank megapipe model's weights (same losses at step 0)."""
    targets = dict(dst.named_parameters())
    seen = set()
    for name, p in src.named_parameters():  # a tied output weight is listed once
        target = targets[plain_name(name)]
        if target.shape != p.shape:
            raise ValueError(f"{name}: {tuple(p.shape)} vs {tuple(target.shape)}")
        target.copy_(p)
        seen.add(plain_name(name))
    missing = set(targets) - seen
    if missing:
        raise ValueError(f"plain parameters without a megapipe counterpart: {sorted(missing)}")


def reference_from_megapipe(model: GPTModel) -> PlainGPT:
    """The PlainGPT of a whole single-rank megapipe model's architecture, with its weights.

    The vocabulary must need no padding (a multiple of --make-vocab-size-divisible-by): the
    plain model has no padding rows, so its softmax would otherwise differ.
    """
    config = model.config
    if model.tp.size != 1 or not (model.pre_process and model.post_process):
        raise ValueError("reference_from_megapipe needs the whole model on one rank (TP=PP=1)")
    if config.padded_vocab_size(1) != config.vocab_size:
        raise ValueError(
            f"--vocab-size {config.vocab_size} is padded to {config.padded_vocab_size(1)}; "
            "use a multiple of --make-vocab-size-divisible-by for the plain reference"
        )
    if config.attention_dropout != config.hidden_dropout:
        raise ValueError(
            f"the plain reference has one dropout; got --attention-dropout "
            f"{config.attention_dropout} and --hidden-dropout {config.hidden_dropout}"
        )
    plain = PlainGPT(
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.vocab_size,
        config.max_position_embeddings,
        config.hidden_dropout,
        config.layernorm_epsilon,
        config.init_method_std,
        ffn_hidden=config.ffn_hidden_size,
        query_groups=config.num_query_groups,
        rope_base=config.rotary_base if config.position_embedding_type == "rope" else None,
        rmsnorm=config.normalization == "RMSNorm",
        swiglu=config.swiglu,
        openai_gelu=config.openai_gelu,
        tied=not config.untie_embeddings_and_output_weights,
        bias=config.add_bias_linear,
        head_dim=config.kv_channels,
        qk_norm=config.qk_layernorm,
        rope_percent=config.rotary_percent,
        squared_relu=config.squared_relu,
        residual_after_norm=config.apply_residual_connection_post_layernorm,
    )
    copy_weights(model, plain)
    return plain.to(next(model.parameters()).device)
