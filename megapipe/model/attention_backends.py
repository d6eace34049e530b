"""Which attention implementation runs (Megatron's --attention-backend), and how its dropout
draws its mask (--attention-dropout-rng).

- auto: `scaled_dot_product_attention`, which picks its fastest backend for the device, dtype
  and mask (flash or memory-efficient on GPUs; causal; GQA without repeating K/V);
- flash: SDPA restricted to its FlashAttention backend, or the `flash_attn` package's kernel
  when it is installed and the tensors are on a GPU in fp16/bf16;
- fused: SDPA restricted to its memory-efficient and cuDNN backends (GPU only);
- unfused / local: softmax(q k^T) v written out (`attention.explicit_attention`).

Attention dropout (`attention_path`):
- fused (the default on CUDA): the kernel that computes attention draws its own mask (SDPA's
  or flash_attn's dropout_p) from the tensor-parallel RNG stream (`RNGTracker.fork`, as
  Megatron does), so TP ranks holding different heads draw different masks and a run is
  reproducible for its seed and layout; nothing [s, s] is materialised for a causal mask;
- layout-invariant (the default on CPU): masks keyed by (seed, sample, layer, site)
  (`model/dropout.py`), the same for every TP/PP/DP layout, which the CPU parity tests need.
  SDPA cannot take an external mask, so this runs the unfused form, and every TP rank draws
  the whole [heads, s, s] mask of each sample. Without sample ids (direct model calls) the
  stream is used as in fused mode.

A forced flash or fused backend with layout-invariant attention dropout is refused, as is
flash with --reset-attention-mask's per-document mask (FlashAttention takes no mask). Whether
a forced backend can run here (with dropout, when the kernel draws it) is probed once at
start-up on the real device and dtype, so a missing kernel is one line naming the flag, not
an error in the first forward.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megapipe.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
ATTENTION_DROPOUT_RNGS = ("auto", "fused", "layout-invariant")
SDPA, FLASH_ATTN, UNFUSED = "sdpa", "flash_attn", "unfused"  # AttentionPath.kernel
NO_DROPOUT, TP_STREAM, LAYOUT_INVARIANT = "none", "tensor-parallel stream", "layout-invariant"
_SDPA = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
}


def unfused(backend: str) -> bool:
    return backend in ("unfused", "local")


def attention_dropout_rng(mode: str, device_type: str) -> str:
    """The --attention-dropout-rng mode that runs on `device_type`: auto is fused on CUDA and
    layout-invariant elsewhere (CPU runs are where layout parity is tested, and their SDPA has
    no fused dropout kernel to lose)."""
    if mode not in ATTENTION_DROPOUT_RNGS:
        raise ConfigError(
            f"--attention-dropout-rng {mode}: choose from {', '.join(ATTENTION_DROPOUT_RNGS)}"
        )
    if mode != "auto":
        return mode
    return "fused" if device_type == "cuda" else "layout-invariant"


@dataclass(frozen=True)
class AttentionPath:
    """How one attention call runs: the kernel (SDPA, FLASH_ATTN or UNFUSED) and where its
    dropout mask comes from (NO_DROPOUT, TP_STREAM or LAYOUT_INVARIANT)."""

    kernel: str
    dropout: str

    @property
    def fused_dropout(self) -> bool:
        """Dropout is drawn inside a fused attention kernel."""
        return self.dropout == TP_STREAM and self.kernel != UNFUSED


def attention_path(
    backend: str,
    *,
    dropout: float,
    dropout_rng: str,
    sample_keyed: bool,
    flash_attn_usable: bool,
    mask: bool,
) -> AttentionPath:
    """The path of one attention call. dropout: its probability now (0 in eval); dropout_rng:
    the resolved mode (`attention_dropout_rng`); sample_keyed: layout-invariant masks were
    given (training with sample ids); flash_attn_usable: the flash_attn package runs these
    tensors; mask: an explicit attention mask (per-document, or a KV cache's offset)."""
    if dropout == 0:
        source = NO_DROPOUT
    elif dropout_rng == "layout-invariant" and sample_keyed:
        return AttentionPath(UNFUSED, LAYOUT_INVARIANT)  # SDPA cannot take our masks
    else:
        source = TP_STREAM
    if unfused(backend):
        return AttentionPath(UNFUSED, source)
    if backend == "flash" and not mask and flash_attn_usable:
        return AttentionPath(FLASH_ATTN, source)
    return AttentionPath(SDPA, source)


def describe_attention(
    backend: str,
    dropout_rng: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    attention_dropout: float,
    reset_attention_mask: bool,
    softmax: str = "reference",
) -> str:
    """The start-up line of what training attention runs, e.g. `attention: sdpa
    (--attention-backend auto), causal by is_causal, dropout 0.1 fused in the kernel from the
    tensor-parallel RNG stream (--attention-dropout-rng auto)`. softmax: the masked_softmax
    implementation the unfused form uses."""
    rng = attention_dropout_rng(dropout_rng, device.type)
    path = attention_path(
        backend,
        dropout=attention_dropout,
        dropout_rng=rng,
        sample_keyed=True,
        flash_attn_usable=backend == "flash" and flash_attn_package_usable(device.type, dtype),
        mask=reset_attention_mask,
    )
    kernel = {
        SDPA: "sdpa",
        FLASH_ATTN: "flash_attn package",
        UNFUSED: f"unfused softmax(QK^T)V (masked_softmax={softmax})",
    }[path.kernel]
    if reset_attention_mask:
        masking = "per-document mask [b, 1, s, s]"
    elif path.kernel == UNFUSED and softmax != "triton":
        masking = "causal mask [s, s]"
    else:
        masking = "causal in the kernel" + (" (is_causal)" if path.kernel == SDPA else "")
    if path.dropout == NO_DROPOUT:
        dropping = "no dropout"
    elif path.dropout == LAYOUT_INVARIANT:
        dropping = f"dropout {attention_dropout} from layout-invariant [heads, s, s] masks"
    else:
        where = "fused in the kernel" if path.fused_dropout else "by torch dropout"
        if path.kernel == SDPA and device.type == "cpu":  # SDPA's CPU kernel has no dropout
            where = "in SDPA's math path (no fused dropout on CPU)"
        dropping = f"dropout {attention_dropout} {where} from the tensor-parallel RNG stream"
    flags = f"--attention-backend {backend}, --attention-dropout-rng {dropout_rng}"
    if dropout_rng == "auto" and attention_dropout > 0:
        flags += f" -> {rng}"
    return f"attention: {kernel}, {masking}, {dropping} ({flags})"


def sdpa_context(backend: str) -> contextlib.AbstractContextManager:
    """The SDPA backend restriction of `backend` (none for auto)."""
    return sdpa_kernel(_SDPA[backend]) if backend in _SDPA else contextlib.nullcontext()


def flash_attn_package_usable(device_type: str, dtype: torch.dtype) -> bool:
    """The `flash_attn` package runs tensors of this device and dtype: installed, on CUDA,
    fp16 or bf16."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_package(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    dropout: float = 0.0,
) -> torch.Tensor:
    """FlashAttention's own kernel on [b, heads, s, d] tensors (GQA native); its dropout draws
    from the device generator (the tensor-parallel stream inside `RNGTracker.fork`)."""
    from flash_attn import flash_attn_func

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scale, causal=causal)
    return out.transpose(1, 2)


def check_attention_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    attention_dropout: float,
    reset_attention_mask: bool,
    head_dim: int = 64,
    dropout_rng: str = "auto",
) -> None:
    """ConfigError naming --attention-backend when the forced backend cannot run here."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend {backend}: choose from {', '.join(ATTENTION_BACKENDS)}"
        )
    rng = attention_dropout_rng(dropout_rng, device.type)
    if backend not in _SDPA:
        return
    if attention_dropout > 0 and rng == "layout-invariant":
        raise ConfigError(
            f"--attention-backend {backend} cannot apply megapipe's layout-invariant attention "
            f"dropout masks (--attention-dropout {attention_dropout}, --attention-dropout-rng "
            f"{dropout_rng} on {device.type}): use --attention-dropout-rng fused, "
            "--attention-dropout 0, or --attention-backend auto or unfused"
        )
    if backend == "flash" and reset_attention_mask:
        raise ConfigError(
            "--attention-backend flash takes no attention mask, and --reset-attention-mask needs "
            "one: use --attention-backend auto"
        )
    if backend == "flash" and flash_attn_package_usable(device.type, dtype):
        return
    probe = torch.zeros(1, 2, 8, head_dim, device=device, dtype=dtype)
    dropout = attention_dropout if rng == "fused" else 0.0
    try:  # the probe's dropout draws from a forked generator: the run's streams do not move
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices), sdpa_context(backend):
            F.scaled_dot_product_attention(probe, probe, probe, dropout_p=dropout, is_causal=True)
    except RuntimeError:
        needs = "a GPU (memory-efficient or cuDNN attention)" if backend == "fused" else (
            "an SDPA flash backend for this device and dtype (GPUs: fp16/bf16, sm80+), or the "
            "flash_attn package"
        )  # fmt: skip
        with_dropout = f" with attention dropout {dropout}" if dropout else ""
        raise ConfigError(
            f"--attention-backend {backend}: not available on {device.type} with {dtype}"
            f"{with_dropout} (it needs {needs})"
        ) from None
