"""Which optional accelerator libraries can run here, found at run time, never at import.

Each probe returns a `Probe` (available, reason): the reason is one short phrase, so that a
forced choice that cannot run fails with a line naming what is missing, and the start-up line
can say why an op fell back to its reference. Nothing here is cached: `detect()` is called once
when the kernels are chosen and its result is passed around (kernels/dispatch.py).

Probes catch every exception: a half-installed CUDA extension raises OSError or RuntimeError,
and the PyPI package named `apex` is an unrelated web toolkit that may fail in any way when
NVIDIA apex's modules are asked of it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Probe(NamedTuple):
    """One library's verdict: can it run here, and why (not)."""

    available: bool
    reason: str


def _import_error(module: str) -> str | None:
    """None if `module` imports, else a one-line description of why not."""
    try:
        importlib.import_module(module)
    except BaseException as error:  # any failure (even SystemExit) means "not usable"
        if isinstance(error, KeyboardInterrupt):
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return f"import {module} failed: {type(error).__name__}: {first_line}"
    return None


def interpreter_on(environ: Mapping[str, str] | None = None) -> bool:
    """TRITON_INTERPRET is set: Triton kernels run on CPU tensors, in numpy (tests only)."""
    environ = os.environ if environ is None else environ
    return environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton_device(x: torch.Tensor) -> None:
    """A one-line error, not Triton's "0 active drivers", for a CPU tensor outside tests."""
    if x.device.type != "cuda" and not interpreter_on():
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (got {x.device.type}); on CPU use the "
            "reference, or set TRITON_INTERPRET=1 before Triton is imported (tests only)"
        )


def triton_probe(environ: Mapping[str, str] | None = None) -> Probe:
    """Triton runs if it imports and there is a CUDA device or its interpreter is on
    (TRITON_INTERPRET=1, for CPU tests only: far too slow to train with). The device and
    environment are checked first, so a CPU run never pays Triton's import (seconds)."""
    if not (torch.cuda.is_available() or interpreter_on(environ)):
        return Probe(False, "Triton needs a CUDA device (or TRITON_INTERPRET=1 in tests)")
    error = _import_error("triton")
    if error is not None:
        return Probe(False, error)
    where = "the CUDA device" if torch.cuda.is_available() else "the interpreter"
    return Probe(True, f"triton on {where}")


def apex_probe() -> Probe:
    """NVIDIA apex's fused norms: the Python classes and their compiled CUDA extension."""
    if not torch.cuda.is_available():
        return Probe(False, "apex's fused norms need a CUDA device")
    error = _import_error("apex.normalization.fused_layer_norm")
    if error is not None:
        return Probe(False, error)
    module = importlib.import_module("apex.normalization.fused_layer_norm")
    missing = [name for name in ("FusedLayerNorm", "FusedRMSNorm") if not hasattr(module, name)]
    if missing:
        return Probe(False, f"apex.normalization has no {', '.join(missing)} (an old apex?)")
    error = _import_error("fused_layer_norm_cuda")  # the extension apex builds with --cuda_ext
    if error is not None:
        return Probe(False, f"apex was built without its CUDA extensions ({error})")
    return Probe(True, "apex fused norms")


def transformer_engine_probe() -> Probe:
    """NVIDIA TransformerEngine's PyTorch layers."""
    if not torch.cuda.is_available():
        return Probe(False, "TransformerEngine needs a CUDA device")
    error = _import_error("transformer_engine.pytorch")
    return Probe(False, error) if error else Probe(True, "transformer_engine.pytorch")


def flash_attn_probe() -> Probe:
    """The flash_attn package's kernels (FlashAttention 2)."""
    if not torch.cuda.is_available():
        return Probe(False, "flash_attn needs a CUDA device")
    error = _import_error("flash_attn")
    if error is not None:
        return Probe(False, error)
    if not hasattr(importlib.import_module("flash_attn"), "flash_attn_func"):
        return Probe(False, "flash_attn has no flash_attn_func")
    return Probe(True, "flash_attn")


@dataclass(frozen=True)
class Availability:
    """What can run here, one Probe per library. Build it with `detect()`, or by hand in
    tests that decide for a machine they are not running on."""

    triton: Probe
    apex: Probe
    te: Probe
    flash_attn: Probe

    @classmethod
    def nothing(cls, reason: str = "not installed") -> Availability:
        """No optional library at all (the plain-torch references only)."""
        return cls(*(Probe(False, reason) for _ in range(4)))


def detect(environ: Mapping[str, str] | None = None) -> Availability:
    """Probe every library now (imports them, which can take seconds on a GPU machine)."""
    return Availability(
        triton=triton_probe(environ),
        apex=apex_probe(),
        te=transformer_engine_probe(),
        flash_attn=flash_attn_probe(),
    )
