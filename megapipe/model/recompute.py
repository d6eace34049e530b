"""Activation recomputation: run a piece of the forward without keeping its activations, and
run it again in backward when its gradients are needed.

Built on `torch.utils.checkpoint` (non-reentrant), plus what it does not know about: the
rank's RNG tracker. torch restores the device generator's state for the recomputed forward, but
dropout here may also draw from the tracker's tensor-parallel stream (`RNGTracker.fork`), whose
state lives in the tracker and changes as the forward goes on. So the tracker's snapshot (both
streams and the fork depth) is taken when the piece first runs and replayed around the
recomputation, which then draws exactly the masks the first forward drew. (Layout-invariant
masks keyed by sample ids, `model/dropout.py`, need no state and replay by construction.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megapipe.config import RecomputeConfig
from megapipe.parallel.random import RNGTracker


def recompute(function: Callable[..., Any], *args: Any, rng: RNGTracker | None) -> Any:
    """`function(*args)`, keeping only `args` for backward, which runs it again.

    rng: the tracker whose streams the recomputation must replay; None leaves only torch's own
    restore of the device generator (enough when `function` draws nothing from the tracker).
    """
    if rng is None:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    snapshot = rng.snapshot()

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), rng.replay(snapshot)

    return checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts
    )


def recomputed_groups(config: RecomputeConfig, layers: int) -> list[range]:
    """The groups of a stage's `layers` layers (local indices) that full recomputation runs
    again as one piece each; layers in no group keep their activations."""
    if not config.full or layers == 0:
        return []
    n = config.num_layers or 1
    if config.method == "block":
        return [range(i, i + 1) for i in range(min(n, layers))]
    return [range(i, min(i + n, layers)) for i in range(0, layers, n)]


def wanted(module: torch.nn.Module) -> bool:
    """Recompute only where a backward will follow: training with gradients on."""
    return module.training and torch.is_grad_enabled()
