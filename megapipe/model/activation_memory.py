"""Activation memory of one transformer layer: measured, and the formula it must match.

Measured: the bytes of the distinct storages autograd saves for backward during a forward
(`torch.autograd.graph.saved_tensors_hooks`), parameters excluded: deterministic, unlike the
allocator's counters.

The formula, for one layer of micro-batch b, sequence s, hidden h, a heads, g query groups,
head size d, ffn size f, TP size t, in elements of the activation dtype (GeLU MLP, learned or
no positions, dropout 0; Korthikanti et al. 2022 count 34 sbh + 5 a s^2 b bytes at 16 bits
with dropout masks and an unfused softmax):

    replicated (without SP):  2 sbh (the two norms' inputs) + 2 sbh (the inputs of the
                              column-parallel QKV and fc1, gathered across TP)
    split over TP:            sb(a + 2g)d / t  (q, k, v: one fused QKV output)
                            + sbh / t          (SDPA's output, which its backward reads; the
                                                output projection's input is a view of it)
                            + 2 sbf / t        (the GeLU's input and fc2's input)
    small, in fp32:           a s b / t        (SDPA's log-sum-exp)
                            + 2 x 2 sb         (LayerNorm's mean and 1/std; RMSNorm: 1 sb each)

With a = g, f = 4h that is sbh (4 + 12/t), against Korthikanti's sbh (10 + 24/t + 5as/(ht))
bytes at 16 bits with masks; SDPA stores no s x s matrix. Under sequence parallelism every
term is split over TP: sbh 16/t. Selective recomputation of core_attn keeps q, k, v (the
recomputation's input) and the projection's input, and drops only SDPA's log-sum-exp (SDPA
holds no s x s matrix to drop; the unfused attention of dropout with sample-keyed masks
does); of mlp it keeps only the MLP's input (the second norm's output) instead of fc1's, the
GeLU's and fc2's inputs. Full recomputation keeps only the input of each recomputed group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megapipe.config import ModelConfig, RecomputeConfig


def saved_activation_bytes(
    forward: Callable[[], object], parameters: Iterable[torch.nn.Parameter]
) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `forward()` runs."""
    params = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def layer_activation_bytes(
    config: ModelConfig,
    micro_batch_size: int,
    tp: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: RecomputeConfig | None = None,
    dtype_bytes: int = 4,
) -> int:
    """The formula of the module docstring: bytes one layer keeps for backward."""
    recompute = recompute or RecomputeConfig()
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    a, g, d = config.num_attention_heads, config.num_query_groups, config.head_dim
    f = config.ffn_hidden_size
    sp = sequence_parallel and tp > 1
    local_s = s // tp if sp else s
    if recompute.full:
        return local_s * b * h * dtype_bytes  # the layer's input (a group of one layer)
    norm_stats = 2 if config.normalization == "LayerNorm" else 1
    norm = local_s * b * h * dtype_bytes + norm_stats * local_s * b * 4  # input + fp32 stats
    column_input = s * b * h // (tp if sp else 1) * dtype_bytes
    qkv = s * b * (a + 2 * g) * d // tp * dtype_bytes
    out = s * b * h // tp * dtype_bytes  # SDPA's output = the projection's input
    lse = 0 if recompute.selective("core_attn") else a * s * b // tp * 4
    attention = norm + column_input + qkv + out + lse
    mlp = column_input + 2 * s * b * f // tp * dtype_bytes
    if recompute.selective("mlp"):
        mlp = local_s * b * h * dtype_bytes  # the MLP's input, kept by the recomputation
    return attention + norm + mlp
