"""The optimizer: fp32 master weights and torch's AdamW/SGD over this rank's shard of the grads.

One class covers plain and distributed (ZeRO-1) data parallelism: it optimizes the pieces of
parameters that fall inside the shard ranges of each GradBuffer (the whole buffer without the
distributed optimizer, 1/DP of each bucket with it; "DP" is the buffers' group, DP x CP with
context parallelism, whose ranks all hold the same parameters). A piece's master weight is a
view of the fp32 parameter buffer itself when parameters are fp32 (no extra copy), else an fp32
copy of the bf16/fp16 values that is cast back after the step. Gradients are the fp32
`main_grad` pieces.

One step: unscale and check for inf/NaN with a single all-reduce (fp16 loss scaling: skip the
step everywhere on overflow), global grad norm over the whole model (TP shards summed, TP
replicas and mirrored tied-embedding copies counted once, stages and DP shards summed; DP
and CP replicas of an unsharded gradient counted once: the model-parallel group holds one of
each), clip, step, write back, all-gather the updated shards.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.config import OptimizerConfig
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.grad_norm import counted_in_norm, sum_of_squares
from megapipe.distributed.loss_scaler import found_inf_or_nan
from megapipe.errors import MegapipeError
from megapipe.layers.param_meta import is_expert
from megapipe.parallel.state import ParallelState

SPIKE_WINDOW = 100  # iterations in --check-for-spiky-loss's running mean


@dataclass(frozen=True)
class Piece:
    """The part [lo, hi) (buffer coordinates) of `param` this rank optimizes."""

    param: torch.nn.Parameter
    buffer: GradBuffer | None  # None: an FSDP2 shard, [lo, hi) in the parameter's own coordinates
    lo: int
    hi: int

    @property
    def start(self) -> int:
        """Where the piece starts in the (TP-local) parameter's flat data."""
        return self.lo - self.param.buffer_offset if self.buffer is not None else self.lo


class NonFiniteGradient(MegapipeError, RuntimeError):
    """The global gradient norm is NaN/Inf (no loss scaler): raised before any update."""

    def __init__(self, norm: float, ranks: list[int], params: list[torch.nn.Parameter]) -> None:
        super().__init__(f"gradient norm {norm} (non-finite gradients on ranks {ranks})")
        self.norm, self.ranks, self.params = norm, ranks, params


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool  # fp16 overflow: nothing was updated
    grad_norm: float  # before clipping; nan when skipped


def _decays(param: torch.nn.Parameter) -> bool:
    """Megatron: no weight decay for biases and norm weights (the 1-D parameters)."""
    return param.dim() > 1


def _embedding_or_output(param: torch.nn.Parameter) -> bool:
    """Megatron's `is_embedding_or_output_parameter` (`ParamMeta.embedding_or_output`)."""
    meta = getattr(param, "meta", None)
    return bool(meta is not None and meta.embedding_or_output)


@dataclass(frozen=True)
class GroupRole:
    """What one param group of the inner optimizer is: decayed or not, and whether
    --decoupled-lr's schedule drives it (the embedding and output layer's groups)."""

    decays: bool
    decoupled: bool = False


def param_groups(
    params: list[torch.nn.Parameter], decoupled: bool = False
) -> list[tuple[GroupRole, list[int]]]:
    """The groups (indices into `params`, empty groups left out): decayed, then not; with
    `decoupled` (--decoupled-lr) the embedding and output layer's apart, after the others."""
    groups = []
    for own_lr in (False, True) if decoupled else (False,):
        for decays in (True, False):
            members = [
                i
                for i, p in enumerate(params)
                if _decays(p) == decays and (not decoupled or _embedding_or_output(p) == own_lr)
            ]
            if members:
                groups.append((GroupRole(decays, own_lr), members))
    return groups


def _adamw(groups: list[dict], lr: float, config: OptimizerConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW: one pass over each tensor, on GPUs and CPUs alike.

    apex's FusedAdam is not needed: torch's fused implementation is the same algorithm. On
    the CPU it took 2.4 ms a step for 0.5 M parameters in 27 tensors where the foreach version
    took 10 ms (one thread, benchmarks/bench_step.py's model); it differs from the foreach and
    single-tensor versions only in rounding (tests/test_golden_reference.py, 1e-5).
    """
    betas = (config.adam_beta1, config.adam_beta2)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=config.adam_eps, fused=True)


def inner_optimizer(
    masters: list[torch.Tensor],
    params: list[torch.nn.Parameter],
    config: OptimizerConfig,
    lr: float,
    decoupled: bool = False,
) -> torch.optim.Optimizer:
    """torch's AdamW (or SGD) over the fp32 masters, each decayed by the rule for the parameter
    it stands for (`params[i]`), in the groups `param_groups(params, decoupled)` gives."""
    groups = [
        {
            "params": [masters[i] for i in members],
            "weight_decay": config.weight_decay if role.decays else 0.0,
        }
        for role, members in param_groups(params, decoupled)
    ]
    if config.optimizer == "adam":
        return _adamw(groups, lr, config)
    return torch.optim.SGD(groups, lr=lr, momentum=config.sgd_momentum)


@dataclass(frozen=True)
class Run:
    """A contiguous range [lo, hi) of one buffer, made of adjacent pieces."""

    buffer: GradBuffer
    lo: int
    hi: int

    def grads(self) -> torch.Tensor:
        return self.buffer.grad_data[self.lo : self.hi]

    def values(self) -> torch.Tensor:
        return self.buffer.param_data[self.lo : self.hi]

    def holds(self, piece: Piece) -> bool:
        return piece.buffer is self.buffer and self.lo <= piece.lo and piece.hi <= self.hi


def merged_runs(pieces: list[Piece], buffers: list[GradBuffer]) -> list[Run]:
    """The pieces' ranges with adjacent ones of a buffer merged: the few large tensors the
    step's whole-shard operations (unscale, inf check, norm, clip, write-back) run over."""
    order = {id(b): i for i, b in enumerate(buffers)}
    runs: list[Run] = []
    for piece in sorted(pieces, key=lambda p: (order[id(p.buffer)], p.lo)):
        last = runs[-1] if runs else None
        if last is not None and last.buffer is piece.buffer and last.hi == piece.lo:
            runs[-1] = Run(last.buffer, last.lo, piece.hi)
        else:
            runs.append(Run(piece.buffer, piece.lo, piece.hi))
    return runs


def _waiter(waits: list[tuple[GradBuffer, object]]):
    def wait(module: torch.nn.Module, inputs) -> None:
        for buffer, bucket in waits:
            buffer.wait_params(bucket)

    return wait


class ShardedOptimizer:
    """AdamW or SGD with fp32 master weights over this rank's shard of the gradient buffers."""

    # Copies of every gradient element the world holds (hybrid sharding's replicas): the
    # world's sum of squares is divided by it.
    norm_replicas: int = 1

    def __init__(
        self,
        buffers: list[GradBuffer],
        state: ParallelState,
        config: OptimizerConfig,
        lr: float,
        scaler=None,
        *,
        decoupled: bool = False,
    ) -> None:
        """`decoupled` (--decoupled-lr): the embedding and output layer in groups of their
        own, whose learning rate `step` sets apart."""
        self.buffers, self.state, self.config, self.scaler = buffers, state, config, scaler
        # The last iterations' losses, which --check-for-spiky-loss compares a loss against
        # (kept here, beside the loss scaler, as the state the step carries between iterations).
        self.loss_history: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._param_gather_hooks: list = []  # --overlap-param-gather's forward pre-hooks
        self.pieces: list[Piece] = []
        for buffer in buffers:
            for shard_lo, shard_hi in buffer.shard_ranges():
                for param in buffer.params:
                    lo = max(shard_lo, param.buffer_offset)
                    hi = min(shard_hi, param.buffer_offset + param.numel())
                    if lo < hi:
                        self.pieces.append(Piece(param, buffer, lo, hi))
        tp_rank = state.tp.rank
        runs = merged_runs(self.pieces, buffers)
        self._grad_runs = [run.grads() for run in runs]
        counted = [p for p in self.pieces if counted_in_norm(p.param, tp_rank)]
        others = [p for p in self.pieces if not counted_in_norm(p.param, tp_rank)]
        # Expert parallelism: EP ranks hold different experts (their own buffers, reduced over
        # fewer ranks than the dense parameters), so the norm sums the two parts apart
        # (`_whole_model_sum`).
        self._expert_parallel = state.ep.size > 1
        self._is_expert = [self._expert_parallel and is_expert(p.param) for p in self.pieces]
        expert_ids = {id(p) for p, e in zip(self.pieces, self._is_expert) if e}
        experts = [p for p in counted if id(p) in expert_ids]
        counted = [p for p in counted if id(p) not in expert_ids]
        self._norm_runs = [run.grads() for run in merged_runs(counted, buffers)]
        self._expert_norm_runs = [run.grads() for run in merged_runs(experts, buffers)]
        # TP replicas counted on another rank: their sum enters the norm times 0, so a NaN/Inf
        # in this rank's copy still makes the norm non-finite (a fault on one rank only).
        self._uncounted_runs = [run.grads() for run in merged_runs(others, buffers)]
        self._copy_back = any(b.param_data.dtype != torch.float32 for b in buffers)
        # fp32: the masters are views of the parameter buffer itself. bf16/fp16: one fp32 copy
        # per run, of which each piece's master is a view (the write-back: one copy per run).
        self._runs = runs
        self._master_runs = [run.values().float() for run in runs] if self._copy_back else []
        self.masters: list[torch.Tensor] = []
        for piece in self.pieces:
            master = piece.buffer.param_data[piece.lo : piece.hi]
            if self._copy_back:
                index = next(i for i, run in enumerate(runs) if run.holds(piece))
                lo = runs[index].lo
                master = self._master_runs[index][piece.lo - lo : piece.hi - lo]
            master.grad = piece.buffer.grad_data[piece.lo : piece.hi]
            self.masters.append(master)
        params = [p.param for p in self.pieces]
        self.inner = inner_optimizer(self.masters, params, config, lr, decoupled)
        self.roles = [role for role, _ in param_groups(params, decoupled)]  # per inner group

    @property
    def has_separate_masters(self) -> bool:
        """bf16/fp16: the fp32 masters are copies; fp32: they are the parameters themselves."""
        return self._copy_back

    @property
    def saves_masters(self) -> bool:
        """Whether checkpoints hold fp32 masters apart from the weights (bf16/fp16)."""
        return self._copy_back

    @property
    def masters_are_weights(self) -> bool:
        """Whether the masters are the very tensors the weights load into (FSDP2's shards)."""
        return False

    def gradient_sync(self, deferred_weight_grads: bool) -> contextlib.AbstractContextManager:
        """Around a step's forward and backward passes: what the gradients' reduction needs
        (nothing here: the grad buffers see deferred weight gradients as they arrive)."""
        return contextlib.nullcontext()

    def after_forward_only(self) -> None:
        """What an evaluation's forward-only pass leaves to undo (nothing here)."""

    def masters_from_weights(self) -> None:
        """Set the fp32 masters from the (just loaded) weights: a checkpoint without them."""
        if self._copy_back:
            for master, piece in zip(self.masters, self.pieces):
                master.copy_(piece.buffer.param_data[piece.lo : piece.hi])

    @property
    def sharded(self) -> bool:
        return any(b.shard for b in self.buffers) and self.state.dp_cp.size > 1

    def grad_norm(self) -> float:
        """L2 norm of the whole model's (unscaled) gradient, identical on every rank.

        One fp32 sum of squares per merged run, added in float64 (grad_norm.sum_of_squares),
        plus 0 x the TP replicas counted elsewhere (finite: no change; NaN/Inf: propagated),
        then ONE all-reduce: over the world when the optimizer is sharded (DP shards, TP
        shards and stages all hold distinct parts), else over the model-parallel group.
        """
        total = sum_of_squares(self._norm_runs, self.state.device)
        if self._uncounted_runs:
            total += 0.0 * sum_of_squares(self._uncounted_runs, self.state.device)
        experts = sum_of_squares(self._expert_norm_runs, self.state.device)
        return math.sqrt(self._whole_model_sum(total, experts))

    def _whole_model_sum(self, total: torch.Tensor, experts: torch.Tensor | None = None) -> float:
        """This rank's float64 sum over the elements it counts -> the whole model's (collective):
        over the world when sharded, else the model-parallel group; replicas divided out.

        With expert parallelism `total` is the dense parameters' part and `experts` the
        experts': one all-reduce over the world, each part divided by how many ranks hold the
        same elements (none when sharded; else DP x CP for dense, the expert-DP size for
        experts, whose EP ranks hold different ones)."""
        if self._expert_parallel:
            if not self.sharded:
                total = total / self.state.dp_cp.size + experts / self.state.expert_dp.size
            elif experts is not None:
                total = total + experts
            dist.all_reduce(total, group=self.state.world.pg)
            return float(total)
        group = self.state.world if self.sharded else self.state.model_parallel
        if group.size > 1:
            dist.all_reduce(total, group=group.pg)
        return float(total) / self.norm_replicas

    def params_norm(self) -> float:
        """L2 norm of the whole model's fp32 master weights (--log-params-norm), each element
        counted once exactly as `grad_norm` counts the gradient's; same on every rank."""
        tp_rank = self.state.tp.rank
        counted: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for master, piece, expert in zip(self.masters, self.pieces, self._is_expert):
            if counted_in_norm(piece.param, tp_rank):
                counted[expert].append(master)
        dense, experts = (sum_of_squares(c, self.state.device) for c in counted)
        return math.sqrt(self._whole_model_sum(dense, experts))

    def num_zeros_in_grad(self) -> float:
        """Zero elements of the whole model's fp32 gradient (--log-num-zeros-in-grad), counted
        as `grad_norm` counts; call it after `step` and before `zero_grad`."""

        def zeros(runs: list[torch.Tensor]) -> torch.Tensor:
            count = sum(g.numel() - int(torch.count_nonzero(g)) for g in runs)
            return torch.tensor(float(count), dtype=torch.float64, device=self.state.device)

        return self._whole_model_sum(zeros(self._norm_runs), zeros(self._expert_norm_runs))

    def set_weight_decay(self, weight_decay: float) -> None:
        """The decayed groups' weight decay (a resumed schedule's, which may not be the
        flag's: --use-checkpoint-opt_param-scheduler)."""
        for group, role in zip(self.inner.param_groups, self.roles, strict=True):
            group["weight_decay"] = weight_decay if role.decays else 0.0

    def step(self, lr: float, decoupled_lr: float | None = None) -> StepOutcome:
        """Update the parameters from their main grads (already finalized over TP/PP/DP), at
        `lr`, the embedding and output layer at `decoupled_lr` when given (--decoupled-lr).

        With `config.check_for_nan_in_loss_and_grad` and no loss scaler, a non-finite norm
        raises NonFiniteGradient (on every rank: the norm is all-reduced) before anything is
        updated. With a scaler, an inf/NaN is an fp16 overflow: the step is skipped.
        """
        self.finish_param_sync()  # the step writes this rank's shard of the parameters
        grads = self._grad_runs
        if self.scaler is not None:
            inv_scale = 1.0 / self.scaler.scale
            if inv_scale != 1.0:
                torch._foreach_mul_(grads, inv_scale)
            if found_inf_or_nan(grads, self.state.world.pg):
                self.scaler.update(True)
                return StepOutcome(skipped=True, grad_norm=float("nan"))
        norm = self.grad_norm()
        if not math.isfinite(norm) and self.config.check_for_nan_in_loss_and_grad:
            raise NonFiniteGradient(norm, self._nonfinite_ranks(), self.nonfinite_params())
        if self.config.clip_grad > 0 and math.isfinite(norm):
            coefficient = self.config.clip_grad / (norm + 1e-6)
            if coefficient < 1.0:
                torch._foreach_mul_(grads, coefficient)
        for group, role in zip(self.inner.param_groups, self.roles, strict=True):
            group["lr"] = decoupled_lr if role.decoupled and decoupled_lr is not None else lr
        self.inner.step()
        for run, master in zip(self._runs, self._master_runs):
            run.values().copy_(master)
        for buffer in self.buffers:
            buffer.all_gather_params(async_op=self.config.overlap_param_gather)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepOutcome(skipped=False, grad_norm=norm)

    def overlap_param_gather_with(self, chunks: list[torch.nn.Module]) -> None:
        """--overlap-param-gather: before a module of `chunks` runs its forward, wait for the
        all-gathers of the buckets holding its parameters (once per model; idempotent).

        Forward pre-hooks, as Megatron-Core's, with one difference that matters: a module
        waits for its whole subtree's parameters, not only its own, because a forward may read
        a child's weight without calling the child (the embedding adds its position table's
        `.weight` directly: with own-parameters-only hooks, PP runs with tied embeddings read
        a stale position table now and then). Only the modules holding the layer stack (an
        nn.ModuleList below them: the chunk, its decoder) wait for their own parameters
        alone, or the first forward would wait for everything. Whatever reads parameters
        outside a forward calls finish_param_sync (the optimizer step, checkpoint saves).
        """
        if self._param_gather_hooks or not self.config.overlap_param_gather:
            return
        for chunk in chunks:
            for module in chunk.modules():
                holds_stack = any(isinstance(m, torch.nn.ModuleList) for m in module.modules())
                params = module.parameters(recurse=not holds_stack)
                owned = [p for p in params if hasattr(p, "grad_buffer")]
                if not owned:
                    continue
                pairs = {(id(p.grad_buffer), id(p.grad_buffer.bucket_of(p))): p for p in owned}
                waits = [(p.grad_buffer, p.grad_buffer.bucket_of(p)) for p in pairs.values()]
                hook = module.register_forward_pre_hook(_waiter(waits))
                self._param_gather_hooks.append(hook)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (--overlap-param-gather)."""
        for buffer in self.buffers:
            buffer.finish_param_sync()

    def nonfinite_params(self) -> list[torch.nn.Parameter]:
        """This rank's parameters with a NaN/Inf in the part of the gradient it optimizes."""
        found: dict[int, torch.nn.Parameter] = {}
        for master, piece in zip(self.masters, self.pieces):
            if not bool(torch.isfinite(master.grad).all()):
                found[id(piece.param)] = piece.param
        return list(found.values())

    def _nonfinite_ranks(self) -> list[int]:
        """Global ranks whose own gradients hold a NaN/Inf (a world all-gather: called only
        once every rank has seen the non-finite all-reduced norm)."""
        local = torch.tensor(
            [float(not all(bool(torch.isfinite(g).all()) for g in self._grad_runs))],
            device=self.state.device,
        )
        if self.state.world.size == 1:
            return [self.state.rank] if local.item() else []
        flags = [torch.zeros_like(local) for _ in range(self.state.world.size)]
        dist.all_gather(flags, local, group=self.state.world.pg)
        return [rank for rank, flag in zip(self.state.world.ranks, flags) if flag.item()]

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.reset()

    def _optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's per-element state (Adam's moments, SGD's momentum)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.inner.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )

    def state_bytes_per_parameter(self) -> dict[str, float]:
        """Measured bytes per model parameter on this rank, by kind (Megatron's memory table)."""
        num_params = sum(p.numel() for b in self.buffers for p in b.params)
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in self.buffers)
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers)
        masters = sum(m.numel() * m.element_size() for m in self.masters) if self._copy_back else 0
        states = self._optimizer_state_bytes()
        return {
            "params": params / num_params,
            "grads": grads / num_params,
            "master": masters / num_params,
            "optimizer": states / num_params,
        }
