"""Layout-invariant initialisation: a parameter's value depends on the seed and its global name.

Each parameter's full tensor is drawn from a generator seeded by (seed, global name), then the
rank keeps its TP shard of it. A 1-rank model and a TP=4 or PP=4 model built with the same seed
therefore hold the same weights, which is what makes the parity tests possible.

The full tensor is generated on the CPU of every TP rank (as Megatron's
--use-cpu-initialization does); for very large embeddings this costs start-up time, not steps.
"""

from __future__ import annotations

import hashlib

import torch

from megapipe.layers.param_meta import ParamMeta, shard_of


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (independent of Python's hash randomisation)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_tensor(seed: int, name: str, meta: ParamMeta) -> torch.Tensor:
    """The parameter's value on a single rank, in fp32 on the CPU."""
    if meta.init_std is None:
        return torch.full(meta.full_shape, meta.init_fill)
    source = meta.copy_of or name
    rows = meta.init_rows if meta.init_rows is not None else meta.full_shape[0]
    parts = []
    for part_name, n in ((source, rows), (source + "#padding", meta.full_shape[0] - rows)):
        if n:
            generator = torch.Generator().manual_seed(name_seed(seed, part_name))
            parts.append(
                torch.empty((n, *meta.full_shape[1:])).normal_(
                    0.0, meta.init_std, generator=generator
                )
            )
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def initialize_parameters(
    module: torch.nn.Module,
    seed: int,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> None:
    """Fill every parameter that carries a `ParamMeta` from its global name (experts: this EP
    rank's block of the full [experts, ...] tensor).

    `module` must be the root whose parameter names are the global ones (GPTModel names its
    layers by global index, so a pipeline stage's names match the full model's).
    """
    for name, param in module.named_parameters():
        meta = getattr(param, "meta", None)
        if meta is None:
            raise ValueError(f"parameter {name} has no ParamMeta; create it with make_param")
        param.copy_(
            shard_of(full_tensor(seed, name, meta), meta, tp_rank, tp_size, ep_rank, ep_size)
        )
