"""FLOPs per iteration against a hand count and torch's FlopCounterMode; peaks; MFU fields."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megapipe.config import ModelConfig
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.training.flops import device_peak_tflops, flops_per_iteration, throughput

GELU_MHA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=16,
    make_vocab_size_divisible_by=64,  # padded vocab 128: the padding is counted
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
SWIGLU_GQA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=48,
    swiglu=True,
    position_embedding_type="rope",
    normalization="RMSNorm",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    vocab_size=100,
    seq_length=16,
    make_vocab_size_divisible_by=64,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def hand_forward_flops(c: ModelConfig, batch: int, vocab: int, *, causal_half: bool) -> int:
    """Every forward GEMM of the model written out as (how many, m, k, n) -> 2mkn each.

    Written from the architecture (one QKV GEMM, per-head score and value GEMMs, one output
    projection, fc1 [and the gate with SwiGLU], fc2, the logits), not from the formula.
    """
    heads, groups, dim = (
        c.num_attention_heads,
        c.num_query_groups,
        c.hidden_size // c.num_attention_heads,
    )
    tokens, s, h, f = batch * c.seq_length, c.seq_length, c.hidden_size, c.ffn_hidden_size
    per_layer = [
        (1, tokens, h, heads * dim + 2 * groups * dim),  # fused QKV
        (batch * heads, s, dim, s),  # scores, one [s, d] x [d, s] per (sample, head)
        (batch * heads, s, s, dim),  # probabilities x values
        (1, tokens, heads * dim, h),  # output projection
        (1, tokens, h, f),  # fc1 (the "up" half with SwiGLU)
        (1, tokens, f, h),  # fc2
    ]
    if c.swiglu:
        per_layer.append((1, tokens, h, f))  # the gate
    total = 0
    for index, (count, m, k, n) in enumerate(per_layer):
        flops = count * 2 * m * k * n
        if causal_half and index in (1, 2):
            flops //= 2  # Megatron's convention: half of the s x s matrix is used
        total += c.num_layers * flops
    return total + 2 * tokens * h * vocab  # logits over the padded vocabulary


@pytest.mark.parametrize("config", [GELU_MHA, SWIGLU_GQA], ids=["gelu-mha", "swiglu-gqa"])
def test_flops_per_iteration_is_three_forward_passes_of_the_hand_count(config) -> None:
    vocab = config.padded_vocab_size(1)
    assert vocab == 128
    expected = 3 * hand_forward_flops(config, 6, vocab, causal_half=True)
    assert flops_per_iteration(config, 6, padded_vocab_size=vocab) == expected


def test_hand_count_of_the_small_gelu_model_in_numbers() -> None:
    # b=1, s=16, h=32, 4 heads of 8, f=128, V=128, 2 layers, forward:
    #   QKV 2*16*32*96 = 98304, scores 4 * 2*16*8*16 / 2 = 8192, values 8192,
    #   proj 2*16*32*32 = 32768, fc1 2*16*32*128 = 131072, fc2 131072
    #   -> per layer 409600, two layers 819200, logits 2*16*32*128 = 131072 -> 950272
    assert flops_per_iteration(GELU_MHA, 1, padded_vocab_size=128) == 3 * 950272


@pytest.mark.parametrize("config", [GELU_MHA, SWIGLU_GQA], ids=["gelu-mha", "swiglu-gqa"])
def test_torch_flop_counter_on_the_real_model_agrees_with_the_hand_count(config) -> None:
    """torch counts the full s x s attention (it cannot know the mask's zeros): compare it
    with the hand count without the causal halving, forward and forward + backward."""
    torch.manual_seed(0)
    state = ParallelState.single()
    model = GPTModel(config, state, RNGTracker(1234), seed=1234)
    batch = 3
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length))
    labels = torch.randint(0, config.vocab_size, (batch, config.seq_length))
    full = hand_forward_flops(config, batch, model.padded_vocab_size, causal_half=False)
    # The math backend runs attention as bmm's that the counter sees; CPU's fused kernel hides them.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward_counter:
            loss = model(tokens, labels=labels).mean()
        with FlopCounterMode(display=False) as backward_counter:
            loss.backward()
    assert forward_counter.get_total_flops() == full
    assert backward_counter.get_total_flops() == 2 * full
    # and the causal halving is the only difference to what we report
    halved = hand_forward_flops(config, batch, model.padded_vocab_size, causal_half=True)
    assert (
        flops_per_iteration(config, batch, padded_vocab_size=model.padded_vocab_size) == 3 * halved
    )
    assert halved < full


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100-PCIE-40GB", torch.float16, 312.0),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA H100 NVL", torch.bfloat16, None),
        ("NVIDIA A100-SXM4-80GB", torch.float32, None),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
        ("cpu", torch.bfloat16, None),
    ],
)
def test_device_peak_tflops(name, dtype, peak) -> None:
    assert device_peak_tflops(name, dtype) == peak


def test_throughput_fields_from_hand_numbers() -> None:
    t = throughput(
        flops_per_iteration=2 * 10**15,
        seconds_per_iteration=2.0,
        tokens_per_iteration=8 * 2048,
        world_size=8,
        peak_tflops=312.0,
    )
    assert t.throughput_tflops_per_gpu == pytest.approx(125.0)  # 2e15 / (2 s x 8 GPUs) / 1e12
    assert t.tokens_per_second_per_gpu == pytest.approx(1024.0)  # 16384 / 16 GPU-seconds
    assert t.mfu == pytest.approx(125.0 / 312.0)
    no_peak = throughput(
        flops_per_iteration=10**12,
        seconds_per_iteration=1.0,
        tokens_per_iteration=1,
        world_size=1,
        peak_tflops=None,
    )
    assert no_peak.mfu is None and no_peak.throughput_tflops_per_gpu == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seconds per iteration"):
        throughput(
            flops_per_iteration=1,
            seconds_per_iteration=0.0,
            tokens_per_iteration=1,
            world_size=1,
            peak_tflops=None,
        )
