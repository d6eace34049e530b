"""Tensor-parallel-aware random number streams for dropout.

Two streams per rank, as in Megatron-LM:

* the *default* stream (torch's own generator on the device), seeded identically on every TP
  rank of a stage, so dropout on replicated activations (after a row-parallel all-reduce)
  draws the same mask everywhere and the replicas stay identical;
* the *tensor-parallel* stream, seeded differently per TP rank, used inside TP regions (the
  attention probabilities of each rank's heads; everything under sequence parallelism), so
  shards of one logical tensor do not share a mask.

`fork()` swaps the device generator's state with the TP stream's for the duration of a block,
so any kernel (scaled_dot_product_attention's dropout, fused kernels) draws from it unchanged.
The tracker is an object passed to the model, not module state.

These streams keep TP replicas consistent but are not layout-invariant: a stream's state
depends on everything the rank drew before, and the TP stream differs per TP rank. Training
therefore passes each micro-batch's global sample ids to the model, whose dropout then uses
masks keyed by (seed, sample, layer, site) instead (`model/dropout.py`); the streams are what
dropout draws from when a caller gives no sample ids, and what attention dropout draws from
inside the fused attention kernel under --attention-dropout-rng fused (the default on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Offsets Megatron-LM uses, so seeds mean the same thing to users of both.
PIPELINE_SEED_OFFSET = 100
TENSOR_PARALLEL_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@dataclass(frozen=True)
class RNGSnapshot:
    """Where both streams stood at one moment: the device generator's state (which is the
    tensor-parallel stream inside a `fork()`), the TP stream's saved state, and the fork depth."""

    device_state: torch.Tensor
    tensor_parallel_state: torch.Tensor
    fork_depth: int


class RNGTracker:
    """The default and tensor-parallel random streams of one rank."""

    def __init__(
        self, seed: int, tp_rank: int = 0, pp_rank: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        self.default_seed = seed + PIPELINE_SEED_OFFSET * pp_rank
        self.tensor_parallel_seed = self.default_seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank
        self._depth = 0
        saved = _get_state(self.device)
        self._seed_device(self.tensor_parallel_seed)
        self._tp_state = _get_state(self.device)
        _set_state(self.device, saved)

    def _seed_device(self, seed: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def seed_default(self) -> None:
        """Seed the device's default generator with this rank's default-stream seed."""
        self._seed_device(self.default_seed)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from the tensor-parallel stream inside the block. Re-entrant."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        outer = _get_state(self.device)
        _set_state(self.device, self._tp_state)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._tp_state = _get_state(self.device)
            _set_state(self.device, outer)

    def snapshot(self) -> RNGSnapshot:
        """Both streams as they are now (activation recomputation replays from here)."""
        return RNGSnapshot(_get_state(self.device), self._tp_state.clone(), self._depth)

    @contextlib.contextmanager
    def replay(self, snapshot: RNGSnapshot) -> Iterator[None]:
        """Run the block with both streams (and the fork depth) as in `snapshot`, then put back
        the streams as they were before the block: a recomputed forward draws the very masks
        the first forward drew, and nothing after it notices."""
        current = self.snapshot()
        self._restore(snapshot)
        try:
            yield
        finally:
            self._restore(current)

    def _restore(self, snapshot: RNGSnapshot) -> None:
        _set_state(self.device, snapshot.device_state)
        self._tp_state = snapshot.tensor_parallel_state.clone()
        self._depth = snapshot.fork_depth

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both streams, for checkpoints (bit-exact resume of dropout masks)."""
        return {"default": _get_state(self.device), "tensor_parallel": self._tp_state.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _set_state(self.device, state["default"])
        self._tp_state = state["tensor_parallel"].clone()
