"""The pipeline as a library: `Pipe(nn.Sequential(...), chunks=8)` over the ranks of a group.

What FairScale's `Pipe` and torch.distributed.pipelining offer, on megapipe's schedules and
executor: every rank builds the whole model (as with FairScale), `Pipe` splits its modules
into contiguous stages (`balance`: counts, or "uniform", "time", "memory"), keeps this rank's
stage(s) and frees the rest, and `step(inputs, targets)` runs one training step of the chosen
schedule over `chunks` micro-batches. Gradients accumulate in the stage parameters' `.grad`
(step your optimizer on `pipe.parameters()`, then zero them); the last stage returns the mean
of the micro-batch losses, the other stages None.

Tensors passed between stages must be single floating-point tensors; their shapes are found
once, at construction, by running `sample_input` through the whole model, so every step must
use batches of that shape. With `virtual_stages=v` each rank holds v stages (stage c*p + r on
rank r, Megatron's interleaving) and the schedule is "interleaved-1f1b".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapipe.data.batch import TrainingBatch
from megapipe.errors import ConfigError
from megapipe.model.activation_memory import saved_activation_bytes
from megapipe.parallel.initialize import default_group_timeout
from megapipe.parallel.state import Group, ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.schedules import P2P, build_schedule, validate_schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PIPE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
BALANCE_METHODS = ("uniform", "time", "memory")


@dataclass(frozen=True)
class Boundary:
    """What one stage hands the next: one micro-batch's output shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class _Stage(nn.Module):
    """The modules of one stage, called the way the executor calls a model chunk: the first
    stage gets the micro-batch's input as `tokens`, later ones `hidden_states`; the last one
    returns `loss_fn(output, labels)`."""

    def __init__(self, modules: Sequence[nn.Module], loss_fn: LossFn | None) -> None:
        super().__init__()
        self.layers = nn.Sequential(*modules)
        self.loss_fn = loss_fn

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        out = self.layers(tokens if hidden_states is None else hidden_states)
        return out if self.loss_fn is None else self.loss_fn(out, labels)


def contiguous_split(weights: Sequence[float], parts: int) -> list[int]:
    """Counts of `parts` contiguous, non-empty runs of `weights` minimising the largest sum."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot split {n} modules into {parts} pipeline stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[s][k]: first k modules, s stages
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for s in range(1, parts + 1):
        for k in range(s, n - (parts - s) + 1):
            for j in range(s - 1, k):
                value = max(best[s - 1][j], prefix[k] - prefix[j])
                if value < best[s][k]:
                    best[s][k], cut[s][k] = value, j
    counts, k = [], n
    for s in range(parts, 0, -1):
        counts.append(k - cut[s][k])
        k = cut[s][k]
    return counts[::-1]


def _module_outputs(modules: Sequence[nn.Module], sample: torch.Tensor) -> list[torch.Tensor]:
    """Each module's output on `sample` (no gradients kept)."""
    outputs, x = [], sample
    with torch.no_grad():
        for index, module in enumerate(modules):
            x = module(x)
            if not isinstance(x, torch.Tensor):
                raise ConfigError(
                    f"Pipe: module {index} ({type(module).__name__}) returns "
                    f"{type(x).__name__}; stages pass one tensor to the next"
                )
            outputs.append(x)
    return outputs


def _time_costs(
    modules: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Median seconds of each module's forward and backward on one micro-batch."""
    costs, x = [], sample
    for module in modules:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = module(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def _memory_costs(modules: Sequence[nn.Module], sample: torch.Tensor) -> list[float]:
    """Bytes each module holds in training: parameters, gradients and Adam's two moments
    (4 copies), plus the activations autograd saves for one micro-batch."""
    costs, x = [], sample
    for module in modules:
        params = list(module.parameters())
        inp = x.detach().requires_grad_(x.is_floating_point())
        out: list[torch.Tensor] = []
        saved = saved_activation_bytes(lambda m=module, i=inp, o=out: o.append(m(i)), params)
        costs.append(4 * sum(p.numel() * p.element_size() for p in params) + saved)
        x = out[0].detach()
    return costs


class Pipe:
    """Pipeline `modules` over the ranks of `group` (default: every rank), one stage per rank
    (or `virtual_stages` per rank), with one of megapipe's schedules.

    Collective at construction: every rank of the group must build it with the same model,
    `sample_input` and options. `sample_input` is one whole batch (what `step` will get),
    `chunks` the number of micro-batches it is cut into along dimension 0.
    """

    def __init__(
        self,
        modules: nn.Sequential | Sequence[nn.Module],
        *,
        chunks: int,
        sample_input: torch.Tensor,
        loss_fn: LossFn,
        balance: Sequence[int] | str = "uniform",
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        p2p_timeout_s: float = 300.0,
    ) -> None:
        modules = list(modules)
        self.state = _pipeline_state(group, torch.device(device))
        p, rank, v = self.state.pp.size, self.state.pp.rank, virtual_stages
        if schedule not in PIPE_SCHEDULES:
            raise ConfigError(f"Pipe: schedule {schedule!r} is not one of {PIPE_SCHEDULES}")
        validate_schedule(schedule, p, v, chunks)
        if sample_input.shape[0] % chunks:
            raise ConfigError(
                f"Pipe: the batch's first dimension ({sample_input.shape[0]}) is not a multiple "
                f"of chunks ({chunks})"
            )
        self.chunks, self.schedule = chunks, schedule
        self.batch_shape = tuple(sample_input.shape)
        micro = sample_input[: sample_input.shape[0] // chunks].to(self.state.device)
        for module in modules:
            module.to(self.state.device)
        self.balance = self._balance(modules, micro, balance, p * v)
        outputs = _module_outputs(modules, micro)
        ends = [sum(self.balance[: s + 1]) for s in range(p * v)]
        self.boundaries = [
            Boundary(tuple(outputs[e - 1].shape), outputs[e - 1].dtype) for e in ends
        ]
        for s, boundary in enumerate(self.boundaries[:-1]):
            if not boundary.dtype.is_floating_point:
                raise ConfigError(
                    f"Pipe: stage {s} would send a {boundary.dtype} tensor; the tensors between "
                    "stages must be floating point (move the cut with balance=[...])"
                )
        starts = [0, *ends[:-1]]
        last = p * v - 1
        mine = [c * p + rank for c in range(v)]
        # global module index -> module, for names that match the unpipelined model's
        self.local_modules = {i: modules[i] for s in mine for i in range(starts[s], ends[s])}
        self.stages = [
            _Stage(modules[starts[s] : ends[s]], loss_fn if s == last else None) for s in mine
        ]
        del modules, outputs  # this rank keeps only its own stages' modules
        self._executor = PipelineExecutor(
            self.stages,
            self.state,
            build_schedule(schedule, p, v, chunks, rank),
            num_microbatches=chunks,
            activation_shape=self.boundaries[0].shape,
            comm=P2PCommunicator(self.state, p2p_timeout_s),
            buffer_spec=self._buffer_spec,
        )

    def _balance(
        self, modules: list[nn.Module], micro: torch.Tensor, balance: Sequence[int] | str, n: int
    ) -> list[int]:
        if not isinstance(balance, str):
            counts = [int(c) for c in balance]
            if len(counts) != n or min(counts) < 1 or sum(counts) != len(modules):
                raise ConfigError(
                    f"Pipe: balance {counts} must give each of the {n} stages at least one "
                    f"module and sum to the {len(modules)} modules"
                )
            return counts
        if balance not in BALANCE_METHODS:
            raise ConfigError(f"Pipe: balance {balance!r} is not one of {BALANCE_METHODS}")
        if balance == "uniform":
            return contiguous_split([1.0] * len(modules), n)
        cost = _time_costs if balance == "time" else _memory_costs
        counts = [contiguous_split(cost(modules, micro), n)]
        if self.state.pp.size > 1:  # measured times differ between ranks: rank 0's decide
            dist.broadcast_object_list(counts, src=self.state.pp.ranks[0], group=self.state.pp.pg)
        return counts[0]

    def _buffer_spec(self, op: P2P) -> tuple[tuple[int, ...], torch.dtype]:
        stage = op.chunk * self.state.pp.size + self.state.pp.rank
        boundary = self.boundaries[stage - 1 if op.phase == "F" else stage]
        return boundary.shape, boundary.dtype

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages' modules)."""
        return [p for stage in self.stages for p in stage.parameters()]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under the names the unpipelined nn.Sequential gives them
        (`"3.weight"`), so state dicts of all ranks together make the whole model's."""
        return {
            f"{index}.{name}": param
            for index, module in self.local_modules.items()
            for name, param in module.named_parameters()
        }

    @property
    def is_first_stage(self) -> bool:
        return self.state.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.state.is_last_stage

    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward of one batch: `inputs` on the first stage, `targets` on the
        last (None elsewhere). Returns the mean micro-batch loss on the last stage."""
        rank = self.state.pp.rank
        if self.is_first_stage and (inputs is None or tuple(inputs.shape) != self.batch_shape):
            got = None if inputs is None else tuple(inputs.shape)
            raise ConfigError(
                f"Pipe.step on pipeline rank {rank}: inputs must have the sample's shape "
                f"{self.batch_shape}, got {got}"
            )
        if self.is_last_stage and targets is None:
            raise ConfigError(f"Pipe.step on pipeline rank {rank} (last stage) needs targets")
        move = lambda t: None if t is None else t.to(self.state.device)
        xs = torch.chunk(move(inputs), self.chunks) if inputs is not None else None
        ys = torch.chunk(move(targets), self.chunks) if targets is not None else None

        def get_batch(i: int) -> TrainingBatch:
            return TrainingBatch(
                tokens=xs[i] if xs is not None else None,
                labels=ys[i] if ys is not None else None,
                loss_mask=None,
            )

        losses = self._executor.run(get_batch)
        return torch.stack(losses).mean() if losses else None


def _pipeline_state(group: dist.ProcessGroup | None, device: torch.device) -> ParallelState:
    """A ParallelState whose pipeline group is `group` (or the world) and nothing else."""
    if not dist.is_initialized():
        one = ParallelState.single(device)
        return one
    me = dist.get_rank()
    if group is None:  # its own group, with the job's timeout (new_group's default is 30 min)
        group = dist.new_group(list(range(dist.get_world_size())), timeout=default_group_timeout())
    ranks = tuple(dist.get_process_group_ranks(group))
    single = Group.single(me)
    pipeline = Group(ranks, ranks.index(me), group if len(ranks) > 1 else None)
    return ParallelState(
        world_size=dist.get_world_size(),
        rank=me,
        world=pipeline,
        tp=single,
        pp=pipeline,
        dp=single,
        model_parallel=pipeline,
        embedding=None,
        device=device,
    )
