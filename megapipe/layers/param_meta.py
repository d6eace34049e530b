"""What a parameter is, globally: its full shape, how TP shards it, and how to initialise it.

Attached to each `nn.Parameter` as `param.meta`. Layout-invariant initialisation, the
sequence-parallel gradient all-reduce, the grad-norm and (later) checkpoint resharding all read
it, so none of them needs to know which layer made the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamMeta:
    """Global description of one parameter.

    full_shape: the shape on a single rank (no tensor parallelism).
    tp_dim: the dimension split across TP ranks, or None when every TP rank holds a replica.
    tp_stride: >1 when the full tensor is `tp_stride` blocks stacked along tp_dim, each split
        across ranks separately (SwiGLU's [gate; up] weight: each rank holds its gate and up).
    init_std: normal(0, init_std) initialisation; None means constant `init_fill`.
    init_rows: for vocabulary-padded tensors, the leading rows drawn from the main stream (the
        real vocabulary), so they do not depend on how much padding a layout needs.
    copy_of: global name of the parameter this one mirrors (the last pipeline stage's copy of a
        tied word embedding): initialised from that name, and counted once in the grad norm.
    sequence_parallel: the replica sees only this rank's sequence shard, so its gradient is
        partial and must be summed over TP before the optimizer step.
    embedding_or_output: the word embedding or the output layer's weight (a tied copy too):
        Megatron's `is_embedding_or_output_parameter`, which --decoupled-lr's schedule drives.
    expert_parallel: an MoE expert parameter: dimension 0 is the global expert id, split into
        contiguous blocks over the expert-parallel group (EP rank r holds experts
        [r E / EP, (r + 1) E / EP)); its gradient is reduced over the expert-data-parallel
        group, not DP x CP, and EP ranks hold different parts of it (the grad norm sums them).
    """

    full_shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_stride: int = 1
    init_std: float | None = None
    init_fill: float = 0.0
    init_rows: int | None = None
    copy_of: str | None = None
    sequence_parallel: bool = False
    embedding_or_output: bool = False
    expert_parallel: bool = False

    @property
    def is_tensor_parallel(self) -> bool:
        return self.tp_dim is not None


def is_expert(param: torch.Tensor) -> bool:
    """An MoE expert parameter (split over expert parallelism, reduced over expert DP)."""
    meta = getattr(param, "meta", None)
    return meta is not None and meta.expert_parallel


def make_param(meta: ParamMeta, tp_size: int, ep_size: int = 1) -> torch.nn.Parameter:
    """An uninitialised parameter of this rank's shard shape, carrying `meta`."""
    shape = list(meta.full_shape)
    if meta.expert_parallel and ep_size > 1:
        if shape[0] % ep_size:
            raise ValueError(f"{shape[0]} experts do not split over {ep_size} EP ranks")
        shape[0] //= ep_size
    if meta.tp_dim is not None:
        if shape[meta.tp_dim] % (tp_size * meta.tp_stride):
            raise ValueError(
                f"dimension {meta.tp_dim} of {meta.full_shape} does not split "
                f"into {tp_size} x {meta.tp_stride}"
            )
        shape[meta.tp_dim] //= tp_size
    param = torch.nn.Parameter(torch.empty(shape))
    param.meta = meta
    return param


def shard_of(
    full: torch.Tensor,
    meta: ParamMeta,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> torch.Tensor:
    """This TP (and, for experts, EP) rank's shard of the full tensor, as `make_param` lays
    it out."""
    if meta.expert_parallel and ep_size > 1:
        full = full.chunk(ep_size, dim=0)[ep_rank]
    if meta.tp_dim is None or tp_size == 1:
        return full
    blocks = full.chunk(meta.tp_stride, dim=meta.tp_dim)
    return torch.cat([b.chunk(tp_size, dim=meta.tp_dim)[tp_rank] for b in blocks], dim=meta.tp_dim)
