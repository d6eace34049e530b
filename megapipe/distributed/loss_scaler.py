"""fp16 loss scaling with Megatron-LM's semantics, and the one-collective overflow check.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward; the
dynamic scaler keeps that scale as large as possible without overflowing. Its rules are
Megatron's `DynamicGradScaler`, reproduced exactly (flags in brackets):

- start at `initial_scale` (--initial-loss-scale, 2**32);
- an overflow resets the growth count and uses up one unit of hysteresis (--hysteresis, 2);
  once none is left, every overflow multiplies the scale by 0.5, never below `min_scale`
  (--min-loss-scale, 1.0). Hysteresis is restored only when the scale grows, not by one clean
  step, so two overflows a few steps apart back off just as two consecutive ones do;
- after `growth_interval` (--loss-scale-window, 1000) clean steps in a row the scale doubles.

The scale is held as the float32 value Megatron's float32 tensor would hold, so scales, the
inverse scale and checkpoints agree with Megatron bit for bit. The caller skips the optimizer
step on overflow (on every rank: the flag is all-reduced) and counts it as skipped.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megapipe.errors import ConfigError


def _fp32(x: float) -> float:
    """`x` rounded to float32, as Megatron's float32 scale tensor stores it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class LossScaler(abc.ABC):
    """Holds the loss scale; `update` is called once per iteration with the global overflow flag."""

    def __init__(self, initial_scale: float) -> None:
        self._scale = _fp32(initial_scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1/scale in float32 (computed in double first, as Megatron does)."""
        return _fp32(1.0 / self._scale)

    @abc.abstractmethod
    def update(self, found_inf: bool) -> None: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ConstantLossScaler(LossScaler):
    """--loss-scale: a fixed scale. Overflowing steps are still skipped, but the scale stays."""

    def __init__(self, scale: float) -> None:
        _require(scale > 0, f"--loss-scale must be positive, got {scale}")
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        del found_inf  # a constant scale ignores overflows

    def state_dict(self) -> dict[str, Any]:
        return {}  # Megatron saves nothing either: the scale comes from the flag

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


class DynamicLossScaler(LossScaler):
    """Megatron's dynamic scaler: back off after `hysteresis` overflows, grow after a window."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        _require(initial_scale > 0, f"--initial-loss-scale must be positive, got {initial_scale}")
        _require(min_scale > 0, f"--min-loss-scale must be positive, got {min_scale}")
        _require(
            min_scale <= initial_scale,
            f"--min-loss-scale ({min_scale}) must not exceed "
            f"--initial-loss-scale ({initial_scale})",
        )
        _require(
            growth_interval > 0, f"--loss-scale-window must be positive, got {growth_interval}"
        )
        _require(hysteresis > 0, f"--hysteresis must be positive, got {hysteresis}")
        _require(growth_factor > 1, f"loss-scale growth factor must exceed 1, got {growth_factor}")
        _require(
            0 < backoff_factor < 1,
            f"loss-scale backoff factor must be in (0, 1), got {backoff_factor}",
        )
        super().__init__(initial_scale)
        self.min_scale = _fp32(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = _fp32(growth_factor)
        self.backoff_factor = _fp32(backoff_factor)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(_fp32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = _fp32(self._scale * self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys and types: the scale as a 1-element float32 tensor, two int trackers."""
        return {
            "scale": torch.tensor([self._scale], dtype=torch.float32),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scale = state_dict["scale"]
        self._scale = _fp32(float(scale.item() if isinstance(scale, torch.Tensor) else scale))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def make_loss_scaler(
    *,
    fp16: bool,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
) -> LossScaler | None:
    """Megatron's choice: --loss-scale gives a constant scaler, else fp16 a dynamic one, else none.

    (Megatron honours --loss-scale only with --fp16/--bf16 or the distributed optimizer; pass
    `loss_scale=None` otherwise.)
    """
    if loss_scale is not None:
        return ConstantLossScaler(loss_scale)
    if fp16:
        return DynamicLossScaler(
            initial_scale=initial_loss_scale,
            min_scale=min_loss_scale,
            growth_interval=loss_scale_window,
            hysteresis=hysteresis,
        )
    return None


def _flag_device(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> torch.device:
    """Where the flag lives: with the grads, or on this rank's GPU if NCCL must reduce it."""
    if grads:
        return grads[0].device
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def found_inf_or_nan(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
    """True on every rank of `group` if any rank's grads hold an inf or NaN.

    One fused reduction per dtype (the max-abs norm is inf or NaN exactly when the tensor has a
    non-finite entry, and unlike the L2 norm it cannot overflow for finite fp16 values), then ONE
    all-reduce. `group=None` means no communication (a group of one), not the world group. Every
    rank of `group` must call this, even one without grads, or the others wait forever.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel() > 0:  # the inf-norm of an empty tensor is undefined (and it is finite)
            by_dtype.setdefault(g.dtype, []).append(g)
    device = _flag_device(grads, group)
    bad = [
        ~torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all()
        for ts in by_dtype.values()
    ]
    flag = torch.stack(bad).any() if bad else torch.zeros((), dtype=torch.bool, device=device)
    flag = flag.to(device=device, dtype=torch.float32)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
