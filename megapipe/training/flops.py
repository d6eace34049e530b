"""Model FLOPs per iteration, device peaks, and the throughput / MFU fields of the log line.

Counting follows current Megatron-LM's `num_floating_point_operations` (dense GPT, MHA/GQA):
only matrix multiplications are counted (norms, softmax, activations and the optimizer are
left out: they are a few percent at real sizes), a GEMM of [m, k] x [k, n] is 2mkn FLOPs, and
every GEMM runs three times per iteration (forward, backward data-gradient, backward
weight-gradient), so an iteration is 3x the forward FLOPs. The causal mask halves the
attention score and attention-over-values GEMMs (only the lower triangle is needed), as
Megatron counts it; the logits GEMM is over the *padded* vocabulary, which is what the output
layer really multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.config import ModelConfig


def flops_per_iteration(
    model: ModelConfig, global_batch_size: int, *, padded_vocab_size: int
) -> int:
    """Floating-point operations of one training iteration (forward + backward), whole model.

    With B = global_batch_size, s = seq_length, L = num_layers, h = hidden_size,
    n = num_attention_heads, g = num_query_groups, d = head_dim (--kv-channels),
    f = ffn_hidden_size, V = padded_vocab_size, the forward pass is

        per layer:  QKV projection          2 B s h d (n + 2g)
                    scores Q K^T (causal)   2 B n s s d / 2
                    attention x V (causal)  2 B n s s d / 2
                    output projection       2 B s (n d) h
                    MLP                     2 B s h f x 2   (GeLU: fc1, fc2)
                                            2 B s h f x 3   (SwiGLU: gate, up, down)
        once:       logits                  2 B s h V

    and the iteration is 3 x (L x per layer + logits). Recomputation is not counted because
    megapipe has none yet. With --rampup-batch-size pass the current global batch size.

    An MoE layer counts its active parameters: the router (2 B s h E), top-k experts' MLPs
    of --moe-ffn-hidden-size each, and the shared expert's MLP, instead of the dense MLP.
    """
    b, s, h = global_batch_size, model.seq_length, model.hidden_size
    n, g, d, f = (
        model.num_attention_heads,
        model.num_query_groups,
        model.head_dim,
        model.ffn_hidden_size,
    )
    tokens = b * s
    qkv = 2 * tokens * h * d * (n + 2 * g)
    scores = 2 * b * n * s * s * d // 2  # Q K^T over heads, halved by the causal mask
    values = 2 * b * n * s * s * d // 2  # softmax(Q K^T) V, halved likewise
    projection = 2 * tokens * n * d * h
    matrices = 3 if model.swiglu else 2
    mlp = 2 * tokens * h * f * matrices
    logits = 2 * tokens * h * padded_vocab_size
    forward = model.num_layers * (qkv + scores + values + projection) + logits
    for layer in range(model.num_layers):
        forward += _moe_mlp_flops(model, tokens) if model.is_moe_layer(layer) else mlp
    return 3 * forward


def _moe_mlp_flops(model: ModelConfig, tokens: int) -> int:
    """Forward FLOPs of one MoE layer: router, top-k experts and the shared expert."""
    moe, h = model.moe, model.hidden_size
    matrices = 3 if model.swiglu else 2
    router = 2 * tokens * h * moe.num_experts
    experts = moe.moe_router_topk * 2 * tokens * h * model.moe_ffn_hidden_size * matrices
    shared = 2 * tokens * h * (moe.moe_shared_expert_intermediate_size or 0) * matrices
    return router + experts + shared


# Dense (no structured sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, from NVIDIA's data
# sheets. The PCIe/SXM split matters on H100 only; A100 PCIe and SXM share one peak.
_DENSE_HALF_PRECISION_PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 PCIE", 756.0),
    ("H100", 989.4),  # SXM (HBM3) parts report as "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),
)


def device_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of one GPU for `dtype`, from its name; None when unknown.

    bf16/fp16 only. fp32 returns None: whether fp32 matmuls run on TF32 tensor cores (A100
    156, H100 SXM 494.7 TFLOP/s dense) or on the plain FP32 units (19.5 / 67) depends on
    `torch.backends.cuda.matmul.allow_tf32`, off by default, so neither number is a safe
    default; pass --device-peak-tflops instead. NVL variants (lower clocks and power) and every
    other device, CPUs included, return None.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    name = device_name.upper()
    if "NVL" in name:
        return None
    for marker, peak in _DENSE_HALF_PRECISION_PEAKS:
        if marker in name:
            return peak
    return None


@dataclass(frozen=True)
class Throughput:
    """The log line's speed fields; names match `log_format.iteration_line`'s keywords."""

    throughput_tflops_per_gpu: float
    tokens_per_second_per_gpu: float
    mfu: float | None  # a fraction of the peak (0.123 prints as "12.3%"); None without a peak


def throughput(
    *,
    flops_per_iteration: int,
    seconds_per_iteration: float,
    tokens_per_iteration: int,
    world_size: int,
    peak_tflops: float | None,
) -> Throughput:
    """Per-GPU speed over the whole world, as Megatron: FLOPs / (time x 1e12 x world size).

    tokens_per_iteration is global batch x seq_length. Every rank counts as a GPU, the
    pipeline's bubble and the communication included: this is model FLOPs utilisation.
    """
    if seconds_per_iteration <= 0:
        raise ValueError(f"seconds per iteration must be positive, got {seconds_per_iteration}")
    if world_size <= 0:
        raise ValueError(f"world size must be positive, got {world_size}")
    gpu_seconds = seconds_per_iteration * world_size
    tflops = flops_per_iteration / (gpu_seconds * 1e12)
    mfu = tflops / peak_tflops if peak_tflops else None
    return Throughput(tflops, tokens_per_iteration / gpu_seconds, mfu)
