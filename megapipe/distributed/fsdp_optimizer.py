"""The optimizer over FSDP2's sharded parameters (ZeRO-2/3): ShardedOptimizer's step, with
FSDP2's fp32 parameter shards as the master weights.

Each rank steps the rows of every parameter it holds (`Piece`s in parameter coordinates, so
checkpoints map them exactly as they map the distributed optimizer's flat ranges). The masters
are the DTensors' local tensors themselves (views: the step updates the shards in place, and
FSDP2 gathers the new values at the next forward); their gradients are the local parts of the
fp32 gradients FSDP2 reduce-scattered, re-read each step because FSDP2 makes new ones after
`zero_grad`. torch's fused AdamW runs on those plain local tensors, as on ZeRO-1's pieces,
instead of on DTensors: no DTensor dispatch per operation, and one implementation of
unscaling, the inf check, the global norm and clipping for every strategy.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule

from megapipe.config import OptimizerConfig
from megapipe.distributed.fsdp import local_part, reduce_after_step, reshard
from megapipe.distributed.grad_norm import counted_in_norm
from megapipe.distributed.optimizer import (
    SPIKE_WINDOW,
    Piece,
    ShardedOptimizer,
    inner_optimizer,
    param_groups,
)
from megapipe.layers.param_meta import is_expert
from megapipe.parallel.state import ParallelState


class FSDPOptimizer(ShardedOptimizer):
    """AdamW or SGD over this rank's FSDP2 shards, with the global norm and clipping of every
    other strategy (`ShardedOptimizer.step`)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        modules: Sequence[FSDPModule],
        state: ParallelState,
        config: OptimizerConfig,
        lr: float,
        scaler=None,
        *,
        decoupled: bool = False,
    ) -> None:
        self.buffers = []  # no GradBuffer: FSDP2 owns the gradients
        self.state, self.config, self.scaler = state, config, scaler
        self.loss_history: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._param_gather_hooks: list = []
        self.modules = list(modules)
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.norm_replicas = state.dp_outer.size if state.dp_outer is not None else 1
        self.pieces, self.masters = [], []
        with torch.no_grad():
            for param in self.params:
                flat, start = local_part(param)
                self.pieces.append(Piece(param, None, start, start + flat.numel()))
                self.masters.append(param.to_local().detach())
        self._counted = [counted_in_norm(p, state.tp.rank) for p in self.params]
        # experts under expert parallelism: their norm part is summed apart (ShardedOptimizer)
        self._expert_parallel = state.ep.size > 1
        self._is_expert = [self._expert_parallel and is_expert(p) for p in self.params]
        self._expert_norm_runs: list[torch.Tensor] = []
        self._copy_back = False  # the masters are the fp32 shards themselves
        self._runs, self._master_runs = [], []
        self._grad_runs, self._norm_runs, self._uncounted_runs = [], [], []
        self.inner = inner_optimizer(self.masters, self.params, config, lr, decoupled)
        self.roles = [role for role, _ in param_groups(self.params, decoupled)]

    @property
    def sharded(self) -> bool:
        return True

    @property
    def saves_masters(self) -> bool:
        """bf16/fp16: the fp32 shards are saved as the masters too, so the checkpoint is the
        one a ZeRO-1 run of the same dtype writes (weights in bf16, fp32_param beside them)."""
        return self.config.params_dtype != torch.float32

    @property
    def masters_are_weights(self) -> bool:
        return True

    def masters_from_weights(self) -> None:
        """Nothing to copy: the weights were loaded into the fp32 shards, the masters."""

    def _refresh_grads(self) -> None:
        """Point the masters at this step's reduce-scattered gradients (new tensors each
        step); a parameter with no gradient (unused this step) gets zeros."""
        grads = []
        for master, param in zip(self.masters, self.params):
            grad = param.grad.to_local() if param.grad is not None else torch.zeros_like(master)
            master.grad = grad
            grads.append(grad)
        self._grad_runs = grads
        counted = [(g, expert) for g, c, expert in zip(grads, self._counted, self._is_expert) if c]
        self._norm_runs = [g for g, expert in counted if not expert]
        self._expert_norm_runs = [g for g, expert in counted if expert]
        self._uncounted_runs = [g for g, counted in zip(grads, self._counted) if not counted]

    def step(self, lr: float, decoupled_lr: float | None = None):
        self._refresh_grads()
        return super().step(lr, decoupled_lr)

    def grad_norm(self) -> float:
        if not self._grad_runs:
            self._refresh_grads()
        return super().grad_norm()

    def zero_grad(self) -> None:
        for master, param in zip(self.masters, self.params):
            master.grad = None
            param.grad = None
        self._grad_runs, self._norm_runs, self._uncounted_runs = [], [], []
        self._expert_norm_runs = []

    def finish_param_sync(self) -> None:
        """Nothing in flight between steps: FSDP2 gathers at each forward."""

    def overlap_param_gather_with(self, chunks: list[torch.nn.Module]) -> None:
        """Prefetching is FSDP2's (set up when the chunks were sharded)."""

    def gradient_sync(self, deferred_weight_grads: bool) -> contextlib.AbstractContextManager:
        """With deferred weight gradients (zero-bubble W), FSDP2's own reduce-scatter at the end
        of each backward would miss them; see `reduce_after_step`."""
        if not deferred_weight_grads:
            return contextlib.nullcontext()
        return reduce_after_step(self.modules)

    def after_forward_only(self) -> None:
        """Free the parameters a no-grad forward left gathered (ZeRO-2 keeps them for a
        backward)."""
        reshard(self.modules)

    def state_bytes_per_parameter(self) -> dict[str, float]:
        """Measured bytes per model parameter on this rank, by kind, at this moment (call it
        after backward to count the sharded gradients)."""
        num_params = sum(p.numel() for p in self.params)
        local = sum(m.numel() * m.element_size() for m in self.masters)
        grads = sum(
            p.grad.to_local().numel() * p.grad.to_local().element_size()
            for p in self.params
            if p.grad is not None
        )
        states = self._optimizer_state_bytes()
        return {
            "params": local / num_params,
            "grads": grads / num_params,
            "master": 0.0,
            "optimizer": states / num_params,
        }
