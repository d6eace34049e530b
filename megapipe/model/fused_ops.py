"""The model's view of the kernel choices (megapipe/kernels/dispatch.py): for an op, the fused
implementation chosen for this run, or None where the model's own plain-torch code runs (every
op on CPU, an op whose fusion flag is off, or one with no fused kernel installed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megapipe.config import KernelConfig
from megapipe.kernels.dispatch import KernelChoices, KernelSettings, choose_kernels


def kernel_choices(kernels: KernelConfig | None, device: torch.device) -> KernelChoices:
    """Every op's implementation for a model on `device` under these flags."""
    return choose_kernels(KernelSettings.from_object(kernels or KernelConfig()), device)


def fused(choices: KernelChoices | None, op: str) -> Callable[..., Any] | None:
    """The fused implementation of `op`, or None for the model's plain-torch path."""
    if choices is None or choices.chosen.get(op, "reference") == "reference":
        return None
    return choices.op(op)
