"""Layout-free checkpoint state: every TP shard, and every flat range of one (the distributed
optimizer's), maps to the right block of the logical tensor, with SwiGLU's two blocks and the
vocabulary padding handled; names are Megatron-Core's stacked ones."""

from __future__ import annotations

import random

import pytest
import torch

from megapipe.checkpointing.layout_free import logical_name, optimizer_shards, regions
from megapipe.layers.param_meta import ParamMeta, shard_of

METAS = {
    "embedding": ParamMeta((256, 6), tp_dim=0, init_rows=100),  # vocab 100 padded to 256
    "swiglu_fc1": ParamMeta((16, 6), tp_dim=0, tp_stride=2),
    "swiglu_bias": ParamMeta((16,), tp_dim=0, tp_stride=2),
    "row_parallel": ParamMeta((6, 16), tp_dim=1),
    "column_parallel": ParamMeta((12, 6), tp_dim=0),
    "norm": ParamMeta((6,)),
}


def reassemble(
    meta: ParamMeta, full: torch.Tensor, tp: int, cuts: int, real_rows_only: bool = False
) -> torch.Tensor:
    """Scatter every TP rank's shard, cut into flat ranges, back into a logical tensor by the
    regions it reports; NaN marks what nothing covered."""
    rows = (meta.init_rows if real_rows_only else None) or meta.full_shape[0]
    out = torch.full((rows, *meta.full_shape[1:]), float("nan"))
    for tp_rank in range(tp if meta.is_tensor_parallel else 1):  # replicas: saved by rank 0
        local = shard_of(full, meta, tp_rank, tp)
        flat = local.reshape(-1)
        bounds = sorted(random.Random(tp_rank).sample(range(1, flat.numel()), cuts))
        for lo, hi in zip([0, *bounds], [*bounds, flat.numel()]):
            for region in regions(
                meta, tp_rank, tp, local.shape, lo, hi, real_rows_only=real_rows_only
            ):
                numel = torch.Size(region.shape).numel()
                piece = flat[region.flat_start : region.flat_start + numel].view(region.shape)
                index = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))
                assert torch.isnan(out[index]).all(), "two pieces claim the same elements"
                out[index] = piece
    return out


@pytest.mark.parametrize("kind", METAS)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("cuts", [0, 3])
@pytest.mark.parametrize("real_rows_only", [False, True], ids=["saving", "loading"])
def test_shards_and_flat_ranges_cover_the_logical_tensor_once(
    kind: str, tp: int, cuts: int, real_rows_only: bool
):
    meta = METAS[kind]
    full = torch.randn(meta.full_shape)
    expected = full  # saving: the padding rows too, as Megatron-LM's padded_vocab_size
    if real_rows_only and meta.init_rows:
        expected = full[: meta.init_rows]  # loading: the real rows only
    assert torch.equal(reassemble(meta, full, tp, cuts, real_rows_only), expected)


def test_names_are_megatron_cores_stacked_ones() -> None:
    assert logical_name("decoder.layers.7.mlp.linear_fc1.weight") == (
        "decoder.layers.mlp.linear_fc1.weight",
        7,
    )
    assert logical_name("decoder.layers.0.input_layernorm.bias") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias",
        0,
    )
    assert logical_name("decoder.layers.3.pre_mlp_layernorm.weight") == (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        3,
    )
    assert logical_name("embedding.word_embeddings.weight") == (
        "embedding.word_embeddings.weight",
        None,
    )


def test_optimizer_state_of_a_flat_range_lands_in_the_stacked_global_tensor() -> None:
    meta = METAS["swiglu_fc1"]
    param = torch.nn.Parameter(torch.zeros(8, 6))  # TP rank 1 of 2
    param.meta = meta
    moment = torch.arange(10, 40, dtype=torch.float32)  # flat elements [10, 40) of the shard
    state = optimizer_shards(
        [
            (
                "decoder.layers.2.mlp.linear_fc1.weight",
                param,
                10,
                moment.clone(),
                {"exp_avg": moment},
            )
        ],
        tp_rank=1,
        tp_size=2,
        num_layers=4,
        include_masters=True,
    )
    assert set(state) == {
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
        "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight",
    }
    out = torch.full((4, 16, 6), float("nan"))
    for shard in state["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]:
        assert shard.global_shape == (4, 16, 6) and shard.offsets[0] == 2
        index = tuple(slice(o, o + s) for o, s in zip(shard.offsets, shard.tensor.shape))
        out[index] = shard.tensor
    # rank 1's local rows 0-3 are gate rows 4-7, local rows 4-7 are up rows 12-15
    local = torch.full((8, 6), float("nan")).view(-1)
    local[10:40] = moment
    local = local.view(8, 6)
    assert torch.allclose(out[2, 4:8], local[0:4], equal_nan=True)
    assert torch.allclose(out[2, 12:16], local[4:8], equal_nan=True)
    assert torch.isnan(out[2, 0:4]).all() and torch.isnan(out[2, 8:12]).all()
