"""The optimizer: fp32 master weights and torch's AdamW/SGD over this rank's shard of the grads.

One class covers plain and distributed (ZeRO-1) data parallelism: it optimizes the pieces of
parameters that fall inside the shard ranges of each GradBuffer (the whole buffer without the
distributed optimizer, 1/DP of each bucket with it). A piece's master weight is a view of the
fp32 parameter buffer itself when parameters are fp32 (no extra copy), else an fp32 copy of the
bf16/fp16 values that is cast back after the step. Gradients are the fp32 `main_grad` pieces.

One step: unscale and check for inf/NaN with a single all-reduce (fp16 loss scaling: skip the
step everywhere on overflow), global grad norm over the whole model (TP shards summed, TP
replicas and mirrored tied-embedding copies counted once, stages and DP shards summed), clip,
step, write back, all-gather the updated shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.config import OptimizerConfig
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.grad_norm import counted_in_norm, sum_of_squares
from megapipe.distributed.loss_scaler import found_inf_or_nan
from megapipe.parallel.state import ParallelState


@dataclass(frozen=True)
class Piece:
    """The part [lo, hi) (buffer coordinates) of `param` this rank optimizes."""

    param: torch.nn.Parameter
    buffer: GradBuffer
    lo: int
    hi: int


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool  # fp16 overflow: nothing was updated
    grad_norm: float  # before clipping; nan when skipped


def _decays(param: torch.nn.Parameter) -> bool:
    """Megatron: no weight decay for biases and norm weights (the 1-D parameters)."""
    return param.dim() > 1


def _adamw(
    groups: list[dict], lr: float, config: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
    """torch's fused AdamW on GPUs (one kernel for all tensors), its foreach version on CPUs.

    apex's FusedAdam is not needed: torch's fused implementation is the same algorithm.
    """
    betas = (config.adam_beta1, config.adam_beta2)
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        groups,
        lr=lr,
        betas=betas,
        eps=config.adam_eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


class ShardedOptimizer:
    """AdamW or SGD with fp32 master weights over this rank's shard of the gradient buffers."""

    def __init__(
        self,
        buffers: list[GradBuffer],
        state: ParallelState,
        config: OptimizerConfig,
        lr: float,
        scaler=None,
    ) -> None:
        self.buffers, self.state, self.config, self.scaler = buffers, state, config, scaler
        self.pieces: list[Piece] = []
        for buffer in buffers:
            for shard_lo, shard_hi in buffer.shard_ranges():
                for param in buffer.params:
                    lo = max(shard_lo, param.buffer_offset)
                    hi = min(shard_hi, param.buffer_offset + param.numel())
                    if lo < hi:
                        self.pieces.append(Piece(param, buffer, lo, hi))
        self.masters: list[torch.Tensor] = []
        for piece in self.pieces:
            values = piece.buffer.param_data[piece.lo : piece.hi]
            master = values if values.dtype == torch.float32 else values.float()
            master.grad = piece.buffer.grad_data[piece.lo : piece.hi]
            self.masters.append(master)
        self._copy_back = any(
            m.data_ptr() != p.buffer.param_data[p.lo :].data_ptr()
            for m, p in zip(self.masters, self.pieces)
        )
        groups = [
            {
                "params": [m for m, p in zip(self.masters, self.pieces) if _decays(p.param)],
                "weight_decay": config.weight_decay,
            },
            {
                "params": [m for m, p in zip(self.masters, self.pieces) if not _decays(p.param)],
                "weight_decay": 0.0,
            },
        ]
        groups = [g for g in groups if g["params"]]
        if config.optimizer == "adam":
            self.inner = _adamw(groups, lr, config, state.device)
        else:
            self.inner = torch.optim.SGD(groups, lr=lr, momentum=config.sgd_momentum)

    @property
    def has_separate_masters(self) -> bool:
        """bf16/fp16: the fp32 masters are copies; fp32: they are the parameters themselves."""
        return self._copy_back

    @property
    def sharded(self) -> bool:
        return any(b.shard for b in self.buffers) and self.state.dp.size > 1

    def grad_norm(self) -> float:
        """L2 norm of the whole model's (unscaled) gradient, identical on every rank."""
        tp_rank = self.state.tp.rank
        grads = [
            m.grad for m, p in zip(self.masters, self.pieces) if counted_in_norm(p.param, tp_rank)
        ]
        total = sum_of_squares(grads, self.state.device)
        if self.sharded:
            dist.all_reduce(total, group=self.state.dp.pg)
        if self.state.model_parallel.size > 1:
            dist.all_reduce(total, group=self.state.model_parallel.pg)
        return math.sqrt(float(total))

    def step(self, lr: float) -> StepOutcome:
        """Update the parameters from their main grads (already finalized over TP/PP/DP)."""
        grads = [m.grad for m in self.masters]
        if self.scaler is not None:
            inv_scale = 1.0 / self.scaler.scale
            if inv_scale != 1.0:
                torch._foreach_mul_(grads, inv_scale)
            if found_inf_or_nan(grads, self.state.world.pg):
                self.scaler.update(True)
                return StepOutcome(skipped=True, grad_norm=float("nan"))
        norm = self.grad_norm()
        if self.config.clip_grad > 0 and math.isfinite(norm):
            coefficient = self.config.clip_grad / (norm + 1e-6)
            if coefficient < 1.0:
                torch._foreach_mul_(grads, coefficient)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self._copy_back:
            for master, piece in zip(self.masters, self.pieces):
                piece.buffer.param_data[piece.lo : piece.hi].copy_(master)
        for buffer in self.buffers:
            buffer.all_gather_params()
        if self.scaler is not None:
            self.scaler.update(False)
        return StepOutcome(skipped=False, grad_norm=norm)

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.reset()

    def state_bytes_per_parameter(self) -> dict[str, float]:
        """Measured bytes per model parameter on this rank, by kind (Megatron's memory table)."""
        num_params = sum(p.numel() for b in self.buffers for p in b.params)
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in self.buffers)
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers)
        masters = sum(m.numel() * m.element_size() for m in self.masters) if self._copy_back else 0
        states = sum(
            t.numel() * t.element_size()
            for s in self.inner.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        return {
            "params": params / num_params,
            "grads": grads / num_params,
            "master": masters / num_params,
            "optimizer": states / num_params,
        }
