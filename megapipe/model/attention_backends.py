"""Which attention implementation runs (Megatron's --attention-backend).

- auto: `scaled_dot_product_attention`, which picks its fastest backend for the device, dtype
  and mask (flash or memory-efficient on GPUs; causal; GQA without repeating K/V);
- flash: SDPA restricted to its FlashAttention backend, or the `flash_attn` package's kernel
  when it is installed and the tensors are on a GPU in fp16/bf16;
- fused: SDPA restricted to its memory-efficient and cuDNN backends (GPU only);
- unfused / local: softmax(q k^T) v written out (`attention.explicit_attention`).

Training with attention dropout uses the unfused form whatever the backend says under auto:
megapipe's layout-invariant dropout masks (`model/dropout.py`) cannot be handed to SDPA. A
forced flash or fused backend with attention dropout is therefore refused, as is flash with
--reset-attention-mask's per-document mask (FlashAttention takes no mask). Whether a forced
backend can run here is probed once at start-up on the real device and dtype, so a missing
kernel is one line naming the flag, not an error in the first forward.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megapipe.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_SDPA = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
}


def unfused(backend: str) -> bool:
    return backend in ("unfused", "local")


def sdpa_context(backend: str) -> contextlib.AbstractContextManager:
    """The SDPA backend restriction of `backend` (none for auto)."""
    return sdpa_kernel(_SDPA[backend]) if backend in _SDPA else contextlib.nullcontext()


def flash_attn_package_usable(q: torch.Tensor) -> bool:
    """The `flash_attn` package runs these tensors: installed, on CUDA, fp16 or bf16."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_package(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """FlashAttention's own kernel on [b, heads, s, d] tensors (GQA native)."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal
    )
    return out.transpose(1, 2)


def check_attention_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    attention_dropout: float,
    reset_attention_mask: bool,
    head_dim: int = 64,
) -> None:
    """ConfigError naming --attention-backend when the forced backend cannot run here."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend {backend}: choose from {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend not in _SDPA:
        return
    if attention_dropout > 0:
        raise ConfigError(
            f"--attention-backend {backend} cannot apply megapipe's layout-invariant attention "
            f"dropout masks (--attention-dropout {attention_dropout}): use --attention-dropout "
            "0, or --attention-backend auto or unfused"
        )
    if backend == "flash" and reset_attention_mask:
        raise ConfigError(
            "--attention-backend flash takes no attention mask, and --reset-attention-mask needs "
            "one: use --attention-backend auto"
        )
    probe = torch.zeros(1, 2, 8, head_dim, device=device, dtype=dtype)
    if backend == "flash" and flash_attn_package_usable(probe):
        return
    try:
        with sdpa_context(backend):
            F.scaled_dot_product_attention(probe, probe, probe, is_causal=True)
    except RuntimeError:
        needs = "a GPU (memory-efficient or cuDNN attention)" if backend == "fused" else (
            "an SDPA flash backend for this device and dtype (GPUs: fp16/bf16, sm80+), or the "
            "flash_attn package"
        )  # fmt: skip
        raise ConfigError(
            f"--attention-backend {backend}: not available on {device.type} with {dtype} "
            f"(it needs {needs})"
        ) from None
