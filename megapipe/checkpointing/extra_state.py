"""Megatron-Core's `_extra_state` byte entries, written beside a torch_dist checkpoint's
tensors so that Megatron-Core's whole `sharded_state_dict()` finds every key it asks for.

Its local spec writes one entry per linear layer: `torch.save([None])` (the linears'
get_extra_state() is None, saved as the list of a ShardedObject's data). The key names the
site and where the object sits, as Megatron-Core 0.16.1 writes them (seen on CPU):

- stacked layers: `decoder.layers.<site>._extra_state/shard_<layer>_<num_layers>`, and per
  expert `decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_<layer>.<e>_
  <num_layers>.<E>`;
- unstacked (non-homogeneous) layers: `decoder.layers.<i>.<site>._extra_state/shard_0_1`,
  per expert `.../shard_<e>_<E>`.

An MoE layer has no dense `mlp.linear_fc1/fc2` sites: its router has none, each expert has
fc1 and fc2, a shared expert has `mlp.shared_experts.linear_fc1/fc2`. TransformerEngine's FP8
scaling state is not kept: a TE model loading None keeps its own (TE's set_extra_state accepts
None). These entries are never read back.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

ATTENTION_SITES = ("self_attention.linear_proj", "self_attention.linear_qkv")
DENSE_MLP_SITES = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_SITES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_SITES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
# the linears of a dense layer of Megatron-Core's layer spec
EXTRA_STATE_SITES = ATTENTION_SITES + DENSE_MLP_SITES
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LayerMLP:
    """What a layer's MLP is: dense (0 experts) or E experts, with or without a shared one."""

    num_experts: int = 0
    shared_expert: bool = False


def layer_mlps(named: Sequence[tuple[str, torch.Tensor]]) -> dict[int, LayerMLP]:
    """Each layer's MLP kind, from a model chunk's global parameter names (and metas)."""
    experts: dict[int, int] = {}
    shared: set[int] = set()
    layers: set[int] = set()
    for name, tensor in named:
        match = _LAYER.match(name)
        if match is None:
            continue
        layer, rest = int(match.group(1)), match.group(2)
        layers.add(layer)
        if rest == "mlp.router.weight":
            meta = getattr(tensor, "meta", None)
            experts[layer] = meta.full_shape[0] if meta is not None else tensor.shape[0]
        elif rest.startswith("mlp.shared_experts."):
            shared.add(layer)
    return {i: LayerMLP(experts.get(i, 0), i in shared) for i in layers}


def _none_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def extra_state_entries(
    layers: Iterable[int] | Mapping[int, LayerMLP], num_layers: int, *, stacked: bool = True
) -> dict[str, bytes]:
    """The `_extra_state` entries of the given (global) layer indices: dense layers (an
    iterable of indices) or each layer's `LayerMLP`."""
    kinds = layers if isinstance(layers, Mapping) else {i: LayerMLP() for i in layers}
    data = _none_bytes()
    out: dict[str, bytes] = {}
    for layer in sorted(kinds):
        kind = kinds[layer]
        prefix = "decoder.layers" if stacked else f"decoder.layers.{layer}"
        where = f"shard_{layer}_{num_layers}" if stacked else "shard_0_1"
        sites = ATTENTION_SITES
        if kind.num_experts == 0:
            sites += DENSE_MLP_SITES
        elif kind.shared_expert:
            sites += SHARED_EXPERT_SITES
        for site in sites:
            out[f"{prefix}.{site}._extra_state/{where}"] = data
        e = kind.num_experts
        for site in EXPERT_SITES if e else ():
            for expert in range(e):
                where = (
                    f"shard_{layer}.{expert}_{num_layers}.{e}" if stacked else f"shard_{expert}_{e}"
                )
                out[f"{prefix}.{site}._extra_state/{where}"] = data
    return out
