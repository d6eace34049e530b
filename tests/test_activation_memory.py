"""Saved activation bytes per layer, counted with saved_tensors_hooks, equal the formula of
megapipe/model/activation_memory.py for every mode: no parallelism, TP2, TP2+SP, selective
(core_attn, mlp) and full recomputation. SP divides a layer's activations by t; full
recomputation keeps only the layer's input; selective mlp drops the MLP's inner activations;
with unfused attention (attention dropout), selective core_attn drops the s x s probabilities."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.config import ModelConfig, RecomputeConfig
from megapipe.model.activation_memory import layer_activation_bytes, saved_activation_bytes
from megapipe.model.dropout import LogicalDropout
from megapipe.model.recompute import recompute
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.mappings import split_along
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

S, B, H, A = 16, 2, 32, 4
CONFIG = ModelConfig(
    num_layers=2, hidden_size=H, num_attention_heads=A, vocab_size=64, seq_length=S,
    max_position_embeddings=S, attention_dropout=0.0, hidden_dropout=0.0,
)  # fmt: skip
MODES = {
    "none": RecomputeConfig(),
    "selective core_attn": RecomputeConfig("selective", modules=("core_attn",)),
    "selective mlp": RecomputeConfig("selective", modules=("mlp",)),
    "selective both": RecomputeConfig("selective", modules=("core_attn", "mlp")),
    "full": RecomputeConfig("full", "uniform", 1),
}


def measured(config: ModelConfig, state: ParallelState, sp: bool, mode: RecomputeConfig,
             masks: LogicalDropout | None = None) -> int:  # fmt: skip
    """Saved bytes of one layer's forward on this rank (its input a fresh [s/t, b, h] shard
    under SP, so it holds no view of a bigger storage)."""
    layer = TransformerLayer(config, state.tp, RNGTracker(1, state.tp_rank), sequence_parallel=sp,
                             recompute=mode).train()  # fmt: skip
    x = torch.randn(S, B, H)
    x = (split_along(x, 0, state.tp) if sp else x).clone().requires_grad_(True)
    if mode.full:  # as the decoder runs a recomputed group
        return saved_activation_bytes(lambda: recompute(layer, x, None, masks, rng=layer.rng),
                                      layer.parameters())  # fmt: skip
    return saved_activation_bytes(lambda: layer(x, None, None, masks), layer.parameters())


def _table(rank: int, world: int, sp: bool) -> dict[str, tuple[int, int]]:
    state = ParallelState.build(world, 1) if world > 1 else ParallelState.single()
    return {
        name: (measured(CONFIG, state, sp, mode),
               layer_activation_bytes(CONFIG, B, world, sequence_parallel=sp, recompute=mode))
        for name, mode in MODES.items()
    }  # fmt: skip


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, tuple[int, int]]]:
    return {
        "1 rank": _table(0, 1, False),
        "TP2": run_distributed(_table, 2, False)[0],
        "TP2+SP": run_distributed(_table, 2, True)[0],
    }


def test_measured_bytes_equal_the_formula(tables) -> None:
    for layout, table in tables.items():
        print(f"\n{layout}: " + ", ".join(f"{k} {m} (formula {f})" for k, (m, f) in table.items()))
        for name, (got, formula) in table.items():
            assert got == formula, (layout, name)


def test_sequence_parallel_divides_activations_by_t(tables) -> None:
    one, sp = tables["1 rank"]["none"][0], tables["TP2+SP"]["none"][0]
    assert sp * 2 == one
    assert tables["TP2"]["none"][0] * 2 > one  # TP alone keeps the replicated part whole


def test_recomputation_keeps_less(tables) -> None:
    for table in tables.values():
        none = table["none"][0]
        assert table["full"][0] == S * B * H * 4 // (2 if table is tables["TP2+SP"] else 1)
        assert table["selective mlp"][0] < none - 8 * S * B * H * 4 // 2 * 0.9
        assert table["selective core_attn"][0] < none


def test_selective_core_attn_drops_the_probabilities_of_unfused_attention() -> None:
    """With attention dropout and sample-keyed masks the attention is unfused: it saves the
    [b, a, s, s] probabilities (and their dropped copy), which core_attn recomputation drops."""
    config = ModelConfig(**{**CONFIG.__dict__, "attention_dropout": 0.1})
    masks = LogicalDropout(3, torch.arange(B))
    state = ParallelState.single()
    plain = measured(config, state, False, MODES["none"], masks)
    selective = measured(config, state, False, MODES["selective core_attn"], masks)
    assert plain - selective >= 2 * B * A * S * S * 4


def _first_stage_extra(rank: int, world: int, sp: bool) -> int:
    """Saved bytes of a first stage (embedding + 1 layer) beyond the layer's formula."""
    from megapipe.model.gpt import GPTModel

    state = ParallelState.build(world, 1)
    model = GPTModel(CONFIG, state, RNGTracker(1), seed=1, layers=range(0, 1),
                     sequence_parallel=sp).train()  # fmt: skip
    tokens = torch.randint(64, (B, S), generator=torch.Generator().manual_seed(0))
    saved = saved_activation_bytes(lambda: model(tokens=tokens), model.parameters())
    return saved - layer_activation_bytes(CONFIG, B, world, sequence_parallel=sp)


def test_the_sequence_parallel_scatter_keeps_only_the_shard() -> None:
    """Under SP the embedding's [s, b, h] output is scattered; the first layer must keep a
    shard of its own, not a view that holds the whole replicated tensor alive."""
    without_sp = run_distributed(_first_stage_extra, 2, False)[0]
    with_sp = run_distributed(_first_stage_extra, 2, True)[0]
    assert with_sp == without_sp  # the token ids only; no [s, b, h] storage
    assert with_sp < S * B * H * 4 // 2


def test_attention_dropout_in_the_kernel_keeps_no_s_by_s_terms():
    # With the kernel's own dropout (CUDA's default) a layer keeps what it keeps without
    # dropout; the layout-invariant masks' unfused attention adds a s^2 b / t x (4 + 2 x 4)
    # bytes and the s^2 causal mask, less SDPA's log-sum-exp (a s b / t x 4).
    dropout = dataclasses.replace(CONFIG, attention_dropout=0.1)
    for tp in (1, 2):
        plain = layer_activation_bytes(CONFIG, B, tp)
        fused = layer_activation_bytes(dropout, B, tp, attention_dropout_fused=True)
        unfused = layer_activation_bytes(dropout, B, tp)
        assert fused == plain
        assert unfused - fused == A * S * S * B // tp * (4 + 2 * 4) + S * S - A * S * B // tp * 4
