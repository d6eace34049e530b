"""Saved activation bytes per layer under context parallelism, counted with
saved_tensors_hooks on real CP ranks, equal megapipe/model/activation_memory.py's formula for
each comm type, with and without GQA and rope, TP x CP with SP, attention dropout's masks, and
each recomputation mode; and the ring's (p2p) bytes are the one-rank bytes divided by CP."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig, RecomputeConfig
from megapipe.model.activation_memory import layer_activation_bytes, saved_activation_bytes
from megapipe.model.dropout import LogicalDropout
from megapipe.model.recompute import recompute
from megapipe.model.rotary import RotaryEmbedding
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

S, B, H, A = 64, 2, 64, 4
MODES = {
    "none": RecomputeConfig(),
    "selective core_attn": RecomputeConfig("selective", modules=("core_attn",)),
    "selective mlp": RecomputeConfig("selective", modules=("mlp",)),
    "full": RecomputeConfig("full", "uniform", 1),
}


def _config(groups: int, positions: str, dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(
        num_layers=1, hidden_size=H, num_attention_heads=A, num_query_groups=groups,
        vocab_size=64, seq_length=S, max_position_embeddings=S, attention_dropout=dropout,
        hidden_dropout=0.0, position_embedding_type=positions,
    )  # fmt: skip


def _measured_and_formula(
    rank: int, world: int, tp: int, comm: str, groups: int, positions: str, sp: bool,
    dropout: float = 0.0,
) -> dict[str, tuple[int, int]]:  # fmt: skip
    cp = world // tp
    state = (
        ParallelState.build(tp, context_parallel_size=cp) if world > 1 else ParallelState.single()
    )
    config = _config(groups, positions, dropout)
    masks = None
    if dropout:  # the layout-invariant masks, as training passes them
        masks = LogicalDropout(3, torch.arange(B), tp_rank=state.tp_rank, tp_size=tp,
                               sequence_parallel=sp, cp_rank=state.cp.rank,
                               cp_size=cp)  # fmt: skip
    rotary = RotaryEmbedding(config.head_dim, S) if positions == "rope" else None
    out = {}
    for name, mode in MODES.items():
        layer = TransformerLayer(config, state.tp, RNGTracker(1, state.tp_rank),
                                 sequence_parallel=sp, recompute=mode,
                                 cp=state.cp).train()  # fmt: skip
        layer.self_attention.cp_comm_type = comm
        local = S // cp // (tp if sp else 1)
        x = torch.randn(local, B, H, requires_grad=True)

        def forward(layer=layer, x=x, full=mode.full):
            if full:  # as the decoder runs a recomputed group
                return recompute(layer, x, rotary, None, masks, rng=layer.rng)
            return layer(x, rotary, None, masks)

        measured = saved_activation_bytes(forward, layer.parameters())
        formula = layer_activation_bytes(config, B, tp, sequence_parallel=sp, recompute=mode,
                                         cp=cp, cp_comm_type=comm)  # fmt: skip
        out[name] = (measured, formula)
    return out


CASES = {
    # id: (world, tp, comm type, query groups, positions, sequence parallel[, dropout])
    "cp1-gqa-rope": (1, 1, "p2p", 2, "rope", False),
    "cp1-gqa": (1, 1, "p2p", 2, "learned_absolute", False),
    "cp2-p2p": (2, 1, "p2p", 4, "learned_absolute", False),
    "cp2-p2p-gqa-rope": (2, 1, "p2p", 2, "rope", False),
    "cp2-all_gather": (2, 1, "all_gather", 4, "learned_absolute", False),
    "cp2-all_gather-gqa-rope": (2, 1, "all_gather", 2, "rope", False),
    "cp2-a2a": (2, 1, "a2a", 4, "learned_absolute", False),
    "cp2-a2a-gqa-rope": (2, 1, "a2a", 2, "rope", False),
    "cp4-p2p-gqa": (4, 1, "p2p", 2, "learned_absolute", False),
    "cp4-all_gather": (4, 1, "all_gather", 4, "rope", False),
    "cp4-a2a": (4, 1, "a2a", 4, "rope", False),
    "tp2-cp2-sp-p2p": (4, 2, "p2p", 2, "rope", True),
    # attention dropout: the rank's share of the layout-invariant mask (all three comm types)
    "cp2-p2p-dropout": (2, 1, "p2p", 2, "rope", False, 0.1),
    "cp2-all_gather-dropout": (2, 1, "all_gather", 4, "learned_absolute", False, 0.1),
    "cp2-a2a-dropout": (2, 1, "a2a", 4, "rope", False, 0.1),
    "cp2-a2a-dropout-gqa": (2, 1, "a2a", 2, "learned_absolute", False, 0.1),
    "tp2-cp2-p2p-dropout-gqa": (4, 2, "p2p", 2, "learned_absolute", False, 0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_bytes_under_context_parallelism_equal_the_formula(case) -> None:
    world, tp, comm, groups, positions, sp, *dropout = CASES[case]
    args = (world, tp, comm, groups, positions, sp, *dropout)
    table = run_distributed(_measured_and_formula, *args) if world > 1 else [
        _measured_and_formula(0, *args)]  # fmt: skip
    for rank_table in table:
        for mode, (measured, formula) in rank_table.items():
            assert measured == formula, (case, mode, measured, formula)


def test_the_ring_divides_a_layers_activations_by_cp() -> None:
    """Independent of the formula: the p2p layer's measured bytes at CP2 and CP4 are the
    one-rank layer's over 2 and 4 (MHA, learned positions: nothing but per-token terms)."""
    one = _measured_and_formula(0, 1, 1, "p2p", 4, "learned_absolute", False)
    for cp in (2, 4):
        table = run_distributed(_measured_and_formula, cp, 1, "p2p", 4, "learned_absolute", False)
        for rank_table in table:
            for mode in MODES:
                assert rank_table[mode][0] * cp == one[mode][0], (cp, mode)
