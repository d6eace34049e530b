"""RoPE against the complex-number rotation it stands for, and past --max-position-embeddings.

Reference: the rotate-half form pairs channel i with channel i + d/2 and turns the pair, read as
the complex number first + i * second, by position * base^(-2i/d). Rope has no learned table,
so a model whose --seq-length exceeds --max-position-embeddings must run (Megatron allows it).
"""

from __future__ import annotations

import math

import torch

from megapipe.config import ModelConfig
from megapipe.model import GPTModel
from megapipe.model.rotary import RotaryEmbedding
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags


class ComplexRotary(torch.nn.Module):
    """Reference RoPE: a complex multiplication per channel pair, angles in float64."""

    def __init__(self, head_dim: int, base: int) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        s, half = x.shape[0], self.head_dim // 2
        freq = [self.base ** (-2 * i / self.head_dim) for i in range(half)]
        positions = range(offset, offset + s)
        angles = torch.tensor([[p * f for f in freq] for p in positions], dtype=torch.float64)
        turn = torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn
        return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def test_rotary_equals_the_complex_rotation() -> None:
    x = torch.randn(12, 2, 3, 8)
    got = RotaryEmbedding(head_dim=8, max_positions=12, base=500)(x)
    torch.testing.assert_close(got, ComplexRotary(8, 500)(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[1:], x[1:])  # positions past 0 really turned


def test_rotary_past_its_first_table_size_equals_the_complex_rotation() -> None:
    rotary = RotaryEmbedding(head_dim=8, max_positions=4, base=10000)
    x = torch.randn(20, 1, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(rotary(x), ComplexRotary(8, 10000)(x), rtol=1e-6, atol=1e-6)
    assert rotary.cos.shape[0] == 20


def test_rotary_at_an_offset_turns_by_the_positions_after_it() -> None:
    """A generation step after a KV cache rotates its tokens as positions offset.. ."""
    rotary = RotaryEmbedding(head_dim=8, max_positions=8, base=10000)
    x = torch.randn(3, 1, 2, 8, dtype=torch.float64)
    got = rotary(x, offset=9)  # past the first table too
    torch.testing.assert_close(got, ComplexRotary(8, 10000)(x, offset=9), rtol=1e-6, atol=1e-6)
    whole = rotary(torch.cat([torch.randn(9, 1, 2, 8, dtype=torch.float64), x]))
    torch.testing.assert_close(got, whole[9:], rtol=1e-12, atol=1e-12)


def test_rope_model_with_seq_length_above_max_position_embeddings_uses_reference_rope() -> None:
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
        max_position_embeddings=4, position_embedding_type="rope", rotary_base=1000,
        attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(config, ParallelState.single(), RNGTracker(3), seed=3).eval()
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        model.rotary = ComplexRotary(config.head_dim, config.rotary_base)
        reference = model(tokens)
    assert logits.shape[0] == 16
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    return [r.lm_loss for r in train_with_flags(rank, world, argv)[0]]


def test_rope_trains_with_seq_length_above_max_position_embeddings() -> None:
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "32",
        "--position-embedding-type", "rope", "--mock-data", "--eval-iters", "0",
        "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "6",
        "--lr", "3e-3", "--attention-dropout", "0", "--hidden-dropout", "0",
    ]  # fmt: skip
    losses = run_distributed(_train, 1, argv)[0]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_bf16_model_keeps_fp32_tables_and_rotates_in_fp32() -> None:
    """In a bf16 model the tables stay fp32 (rebuilt, not rounded) and the rotation runs in
    fp32 with one rounding of the result: the float64 rotation correctly rounded to bf16 in all
    but a few entries (those within fp32 error of a rounding midpoint: one bf16 ulp off), where
    the old path (bf16 tables and arithmetic) rounded 39% of them wrongly (here: 3e-5 against
    0.39 of the entries off; max error 0.015 against 0.031)."""
    config = ModelConfig(
        num_layers=1, hidden_size=64, num_attention_heads=2, vocab_size=64, seq_length=8,
        max_position_embeddings=4096, position_embedding_type="rope", rotary_base=10000,
    )  # fmt: skip
    model = GPTModel(config, ParallelState.single(), RNGTracker(3), seed=3).to(torch.bfloat16)
    rotary = model.rotary
    fresh = RotaryEmbedding(config.head_dim, 4096, 10000)
    assert rotary.cos.dtype == rotary.sin.dtype == torch.float32
    assert torch.equal(rotary.cos, fresh.cos) and torch.equal(rotary.sin, fresh.sin)
    x = torch.randn(4096, 1, 2, config.head_dim, generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()
    exact = ComplexRotary(config.head_dim, 10000)(x.double())
    rounded = exact.bfloat16()  # the best a bf16 output can be
    got = rotary(x)
    assert got.dtype == torch.bfloat16
    error = (got.double() - exact).abs()
    assert float((got == rounded).float().mean()) > 0.999
    assert bool((error <= exact.abs() * 2.0**-8 + 1e-6).all())  # at most one ulp
    first, second = x.chunk(2, dim=-1)  # the old path: bf16 tables, bf16 arithmetic
    old = x * fresh.cos.bfloat16() + torch.cat([-second, first], dim=-1) * fresh.sin.bfloat16()
    old_error = (old.double() - exact).abs()
    assert float((old == rounded).float().mean()) < 0.7
    assert float(error.mean()) < float(old_error.mean())
    assert float(error.max()) < 0.6 * float(old_error.max())
