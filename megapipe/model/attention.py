"""Causal self-attention with heads (and GQA query groups) split across TP ranks.

Attention runs through torch's fused scaled_dot_product_attention (causal by is_causal, no
[s, s] mask), with its dropout drawn inside the kernel from the tensor-parallel RNG stream
(--attention-dropout-rng fused, the default on CUDA). Training with layout-invariant dropout
masks (`model/dropout.py`, the default on CPU) computes softmax -> dropout(our mask) -> matmul
explicitly instead, since SDPA cannot take our mask (the [b, heads, s, s] probabilities are
materialised, as in any unfused attention). `attention_backends.attention_path` decides.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.data.context_parallel_split import chunk_positions
from megapipe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megapipe.layers.norms import build_norm
from megapipe.model.attention_backends import (
    FLASH_ATTN,
    LAYOUT_INVARIANT,
    UNFUSED,
    AttentionPath,
    attention_dropout_rng,
    attention_path,
    flash_attn_package,
    flash_attn_package_usable,
    sdpa_context,
)
from megapipe.model.context_parallel import context_parallel_attention
from megapipe.model.dropout import LogicalDropout
from megapipe.model.kv_cache import KVCache
from megapipe.model.recompute import recompute, wanted
from megapipe.model.rotary import RotaryEmbedding
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group


class SelfAttention(torch.nn.Module):
    """QKV projection -> (q/k norms) -> (rotary) -> scaled_dot_product_attention -> output
    projection.

    The fused QKV weight uses Megatron's layout, grouped per query group:
    [group 0: q_0..q_{k-1}, k, v | group 1: ...] with k = heads / groups, so a contiguous TP
    split hands each rank whole query groups with their keys and values.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        rng: RNGTracker,
        *,
        output_init_std: float,
        sequence_parallel: bool,
        layer_number: int = 0,
        recompute_core: bool = False,
        backend: str = "auto",
        softmax_kernel: Callable[..., torch.Tensor] | None = None,
        dropout_rng: str = "auto",
        cp: Group | None = None,
        cp_comm_type: str = "p2p",
        cp_emulate_nccl_order: tuple[str, ...] = (),
    ) -> None:
        """cp: the context-parallel group; with more than one rank, each holds its chunks of
        every sequence (`data/context_parallel_split.py`) and the core attention runs over the
        group (`context_parallel_attention`, `cp_comm_type`: p2p, all_gather or a2a;
        `cp_emulate_nccl_order`: the NCCL rules the p2p ring runs under on gloo,
        --emulate-nccl-p2p-order)."""
        super().__init__()
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.cp_comm_type = cp_comm_type
        self.cp_emulate_nccl_order = cp_emulate_nccl_order
        self.rng = rng
        self.recompute_core = recompute_core  # --recompute-granularity selective (core_attn)
        self.backend = backend  # --attention-backend (model/attention_backends.py)
        self.dropout_rng = dropout_rng  # --attention-dropout-rng: auto, fused, layout-invariant
        self.softmax_kernel = softmax_kernel  # fused masked softmax of the unfused attention
        self.layer_number = layer_number  # global index: keys this layer's dropout masks
        self.dropout = config.attention_dropout
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp.size
        self.local_groups = config.num_query_groups // tp.size
        self.queries_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.head_dim * (config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            tp,
            init_std=config.init_method_std,
            bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel,
        )
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            tp,
            init_std=output_init_std,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            sequence_parallel=sequence_parallel,
        )
        # --qk-layernorm: one norm over the head dim for all query heads, one for all key
        # heads, replicated over TP. Each rank normalises only its own heads, so the weights'
        # gradients are partial sums: marked like sequence-parallel norms, summed over TP.
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            partial_grads = tp.size > 1
            eps = config.layernorm_epsilon
            self.q_layernorm = build_norm(config.normalization, self.head_dim, eps, partial_grads)
            self.k_layernorm = build_norm(config.normalization, self.head_dim, eps, partial_grads)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None,
        attention_mask: torch.Tensor | None = None,
        dropout_masks: LogicalDropout | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """attention_mask: None for plain causal attention, else [b, 1, s, s] bool, True where
        a query may attend a key (--reset-attention-mask: causal within each document); under
        context parallelism [b, s_local] document ids instead (`_context_parallel`).

        dropout_masks: layout-invariant masks for this micro-batch, used for the attention
        probabilities under --attention-dropout-rng layout-invariant; otherwise (or without
        them) training dropout draws from the rank's tensor-parallel stream inside SDPA.

        kv_cache: generation. x holds the tokens at positions kv_cache.offset..; their keys and
        values join the cache and the queries attend over every cached position (causally).
        """
        qkv, _ = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.queries_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.queries_per_group].reshape(s, b, self.local_heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        offset = kv_cache.offset if kv_cache is not None else 0
        if self.cp is not None:
            return self._context_parallel(q, k, v, rotary, attention_mask, kv_cache, dropout_masks)
        if rotary is not None:
            q, k = rotary(q, offset), rotary(k, offset)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        causal = attention_mask is None
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v)
            if offset > 0:  # SDPA's is_causal aligns top-left; new queries sit bottom-right
                causal = False
                if s > 1 and attention_mask is None:
                    attention_mask = cached_causal_mask(s, offset, q.device)
        core = partial(self.core, causal=causal, dropout_masks=dropout_masks)
        if self.recompute_core and wanted(self):
            out = recompute(core, q, k, v, attention_mask, rng=self.rng)
        else:
            out = core(q, k, v, attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.linear_proj(out)

    def _context_parallel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding | None,
        attention_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        dropout_masks: LogicalDropout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's rest under context parallelism: q [s_local, b, heads, d] of this rank's
        chunks, rotated at their global positions, attending over the whole sequence.

        Attention dropout applies the whole sequence's keep-mask [b, heads, S, S] at each
        (query, key) pair's global positions (`context_parallel_attention`): the layout-
        invariant one (`dropout_masks`, the one-rank run's mask) when the path is layout-
        invariant, else one drawn from the tensor-parallel stream (not the one-rank run's). It
        is drawn inside the core, so selective recomputation draws it again.

        attention_mask: None, or under --reset-attention-mask this rank's per-token document
        ids ([b, s_local] ints, data/context_parallel_split.py): attention stays within each
        document. Rotary and the causal order both use the global sequence index (as the
        one-rank path's rotary does); --reset-position-ids only moves learned embeddings."""
        documents_ok = attention_mask is None or (
            attention_mask.dim() == 2 and not attention_mask.is_floating_point()
            and attention_mask.dtype != torch.bool
        )  # fmt: skip
        if not documents_ok or kv_cache is not None:
            raise NotImplementedError(
                "context parallelism supports causal training attention with optional [b, s] "
                "document ids only (no [b, 1, s, s] masks, no KV cache)"
            )
        s, b = q.shape[:2]
        positions = chunk_positions(s * self.cp.size, self.cp.size, self.cp.rank).to(q.device)
        if rotary is not None:
            q, k = rotary(q, positions=positions), rotary(k, positions=positions)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        core = partial(
            self._context_parallel_core, document_ids=attention_mask, dropout_masks=dropout_masks
        )
        if self.recompute_core and wanted(self):
            out = recompute(core, q, k, v, rng=self.rng)
        else:
            out = core(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.linear_proj(out)

    def _context_parallel_core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        document_ids: torch.Tensor | None,
        dropout_masks: LogicalDropout | None,
    ) -> torch.Tensor:
        """`context_parallel_attention` of q [b, heads, s_local, d], with attention dropout's
        whole-sequence keep-mask when training with dropout (see `_context_parallel`)."""
        dropout = self.dropout if self.training else 0.0
        mask, stream = None, contextlib.nullcontext()
        if dropout > 0:
            seq_len = q.shape[2] * self.cp.size
            shape = (q.shape[0], self.local_heads, seq_len, seq_len)
            if self.path(q, None, dropout_masks is not None).dropout == LAYOUT_INVARIANT:
                layer = self.layer_number
                mask = dropout_masks.attention_keep_mask(shape, dropout, layer, q.device)
            else:  # drawn by context_parallel_attention from the tensor-parallel stream
                stream = self.rng.fork()
        with stream:
            return context_parallel_attention(
                q,
                k,
                v,
                self.cp,
                comm_type=self.cp_comm_type,
                scale=1.0 / math.sqrt(self.head_dim),
                document_ids=document_ids,
                dropout_p=dropout,
                dropout_mask=mask,
                emulate_nccl_order=self.cp_emulate_nccl_order,
            )

    def path(
        self, q: torch.Tensor, attention_mask: torch.Tensor | None, sample_keyed: bool
    ) -> AttentionPath:
        """The AttentionPath a call with these queries (device, dtype) and mask takes now."""
        flash = self.backend == "flash" and flash_attn_package_usable(q.device.type, q.dtype)
        return attention_path(
            self.backend,
            dropout=self.dropout if self.training else 0.0,
            dropout_rng=attention_dropout_rng(self.dropout_rng, q.device.type),
            sample_keyed=sample_keyed,
            flash_attn_usable=flash,
            mask=attention_mask is not None,
        )

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        causal: bool,
        dropout_masks: LogicalDropout | None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, with dropout on the probabilities: [b, heads, s, d]."""
        dropout = self.dropout if self.training else 0.0
        scale = 1.0 / math.sqrt(self.head_dim)
        path = self.path(q, attention_mask, dropout_masks is not None)
        explicit = partial(explicit_attention, causal=causal, softmax=self.softmax_kernel)
        if path.dropout == LAYOUT_INVARIANT:
            layer = self.layer_number
            return explicit(
                q,
                k,
                v,
                attention_mask,
                scale,
                lambda probs: dropout_masks.attention_probs(probs, dropout, layer),
            )
        with self.rng.fork() if dropout > 0 else contextlib.nullcontext():
            if path.kernel == UNFUSED:
                drop = partial(F.dropout, p=dropout, training=True) if dropout > 0 else _identity
                return explicit(q, k, v, attention_mask, scale, drop)
            if path.kernel == FLASH_ATTN:
                return flash_attn_package(q, k, v, scale, causal, dropout)
            with sdpa_context(self.backend):
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=attention_mask,
                    dropout_p=dropout,
                    is_causal=causal,
                    scale=scale,
                    enable_gqa=self.local_groups != self.local_heads,
                )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def cached_causal_mask(s: int, offset: int, device: torch.device) -> torch.Tensor:
    """[s, offset + s] bool: query i (position offset + i) may attend keys 0..offset + i."""
    return torch.ones(s, offset + s, dtype=torch.bool, device=device).tril(offset)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    drop: Callable[[torch.Tensor], torch.Tensor],
    causal: bool = True,
    softmax: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) -> drop -> @ v, the unfused form of SDPA.

    q: [b, heads, s, d]; k, v: [b, groups, s, d] (GQA: head i reads group i // (heads/groups),
    as SDPA's enable_gqa). attention_mask: None for causal, else [b, 1, s, s] bool (True = may
    attend). The softmax runs in fp32 and is cast back to q's dtype before dropout.
    causal: with no mask, whether to apply the causal one (False: attend everything, as a
    one-token generation step after a KV cache does).
    softmax: a fused masked softmax (scores, mask, scale) -> probs in q's dtype, or None. A
    causal call hands it no mask (its own causal mode), so no [s, s] mask is built for it.
    """
    heads, groups = q.shape[1], k.shape[1]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1))
    s_q, s_k = scores.shape[-2:]
    if softmax is not None:
        if attention_mask is None and causal and s_q != s_k:  # the kernel's causal is bottom-right
            attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        if attention_mask is None and not causal:
            attention_mask = torch.ones(1, 1, 1, s_k, dtype=torch.bool, device=q.device)
        return torch.matmul(drop(softmax(scores, attention_mask, scale)), v)
    scores = scores * scale
    if attention_mask is None and causal:
        attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(drop(probs), v)
