"""N-dimensional checkpoint regions (`checkpointing.regions`): for hand-built ParamMetas of
experts (dimension 0 split over EP, a TP dimension with or without SwiGLU's stride), every
rank's tensor, whole or cut into flat ranges (the distributed optimizer's), maps onto the
global tensor so that the union covers it exactly once, each region a contiguous run of the
rank's flat data; and the rank's own tensor is what `shard_of` gives it."""

from __future__ import annotations

import random

import pytest
import torch

from megapipe.checkpointing.regions import regions
from megapipe.layers.param_meta import ParamMeta, make_param, shard_of

E, FFN, H = 8, 12, 6
METAS = {
    "experts fc1 (SwiGLU)": ParamMeta((E, 2 * FFN, H), tp_dim=1, tp_stride=2, expert_parallel=True),
    "experts fc1": ParamMeta((E, FFN, H), tp_dim=1, expert_parallel=True),
    "experts fc2": ParamMeta((E, H, FFN), tp_dim=2, expert_parallel=True),
    "experts bias1 (SwiGLU)": ParamMeta((E, 2 * FFN), tp_dim=1, tp_stride=2, expert_parallel=True),
    "experts bias2": ParamMeta((E, H), expert_parallel=True),
    "router": ParamMeta((E, H)),
    "experts split by EP and TP on dimension 0": ParamMeta((E, H), tp_dim=0, expert_parallel=True),
    "3-D, TP on dimension 0": ParamMeta((2 * FFN, 4, H), tp_dim=0, tp_stride=2),
    "embedding": ParamMeta((16, H), tp_dim=0, init_rows=10),
}


def _reassemble(meta: ParamMeta, full: torch.Tensor, tp: int, ep: int, cuts: int, real: bool):
    rows = (meta.init_rows if real else None) or meta.full_shape[0]
    out = torch.full((rows, *meta.full_shape[1:]), float("nan"))
    for ep_rank in range(ep if meta.expert_parallel else 1):  # EP replicas: written once
        for tp_rank in range(tp if meta.is_tensor_parallel else 1):
            local = shard_of(full, meta, tp_rank, tp, ep_rank, ep)
            assert local.shape == make_param(meta, tp, ep).shape
            flat = local.reshape(-1)
            seed = random.Random(tp_rank + 7 * ep_rank)
            bounds = sorted(seed.sample(range(1, flat.numel()), cuts))
            for lo, hi in zip([0, *bounds], [*bounds, flat.numel()]):
                found = regions(meta, tp_rank, tp, local.shape, lo, hi, real_rows_only=real,
                                ep_rank=ep_rank, ep_size=ep)  # fmt: skip
                assert all(lo <= r.flat_start < hi for r in found)
                assert sum(torch.Size(r.shape).numel() for r in found) <= hi - lo
                for region in found:
                    numel = torch.Size(region.shape).numel()
                    assert region.flat_start + numel <= hi
                    piece = flat[region.flat_start : region.flat_start + numel].view(region.shape)
                    index = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))
                    assert torch.isnan(out[index]).all(), "two pieces claim the same elements"
                    out[index] = piece
    return out


@pytest.mark.parametrize("kind", METAS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("cuts", [0, 5])
def test_regions_cover_the_global_tensor_exactly_once(kind: str, tp: int, ep: int, cuts: int):
    meta = METAS[kind]
    full = torch.randn(meta.full_shape)
    assert torch.equal(_reassemble(meta, full, tp, ep, cuts, real=False), full)
    if meta.init_rows:  # loading: the real vocabulary rows only
        assert torch.equal(_reassemble(meta, full, tp, ep, cuts, real=True), full[:10])


def test_a_whole_expert_shard_is_few_regions() -> None:
    """EP rank 1 of 2 at TP 2: fc2 [E/2, h, ffn/2] and fc1 [E/2, ffn/2, h] are one region each
    (a TP dimension without a stride is one run); with SwiGLU's stride, fc1 is a gate and an
    up block per expert."""
    fc2 = regions(METAS["experts fc2"], 1, 2, (E // 2, H, FFN // 2), 0, E // 2 * H * FFN // 2,
                  ep_rank=1, ep_size=2)  # fmt: skip
    assert [(r.shape, r.offsets) for r in fc2] == [((E // 2, H, FFN // 2), (E // 2, 0, FFN // 2))]
    fc1 = regions(METAS["experts fc1"], 1, 2, (E // 2, FFN // 2, H), 0, E // 2 * FFN // 2 * H,
                  ep_rank=1, ep_size=2)  # fmt: skip
    assert [(r.shape, r.offsets) for r in fc1] == [((E // 2, FFN // 2, H), (E // 2, FFN // 2, 0))]
    glu = regions(METAS["experts fc1 (SwiGLU)"], 0, 2, (E // 2, FFN, H), 0, E // 2 * FFN * H,
                  ep_rank=1, ep_size=2)  # fmt: skip
    assert [(r.shape, r.offsets) for r in glu[:2]] == [
        ((1, FFN // 2, H), (E // 2, 0, 0)),
        ((1, FFN // 2, H), (E // 2, FFN, 0)),
    ]
    assert len(glu) == 2 * (E // 2)
