"""What a training checkpoint holds, gathered from and restored into a live run.

- model: every parameter (and the routers' expert biases) as pieces of layout-free logical
  tensors (`layout_free`), written by data-parallel rank 0 of each model-parallel rank; with
  expert parallelism the experts by every EP rank of the first expert-data-parallel replica
  (each its block of experts), the optimizer's expert state alike;
- optimizer: Adam's moments (SGD's momentum) and, in bf16/fp16, the fp32 masters, per
  parameter in the same global shapes; with the distributed optimizer each data-parallel rank
  writes the part it owns, otherwise data-parallel rank 0 writes it all;
- common (one copy): iteration, consumed samples, the LR schedule's clock (samples of
  successful updates), the optimizer's step count, the loss scaler, how many evaluations each
  split has run, the layout, the real vocabulary size (`true_vocab_size`), the run's
  arguments as Megatron-LM's `args` Namespace (`megatron_args`) and as megapipe's strings
  (`megapipe_args`);
- Megatron-Core's `_extra_state` byte entries of every layer (`extra_state_to_save`), written
  once and never read back;
- random state of every rank (python, numpy, torch, CUDA, the TP stream): restored only at the
  same layout. Dropout masks depend on (seed, sample, layer, site) alone, so a resumed run is
  exact at any layout without them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megapipe.checkpointing.extra_state import extra_state_entries, layer_mlps
from megapipe.checkpointing.layout_free import (
    OPTIMIZER_STATES,
    checkpointed_tensors,
    model_shards,
    optimizer_shards,
)
from megapipe.checkpointing.scheduler_rule import saved_settings
from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.layers.param_meta import is_expert
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


@dataclass
class Progress:
    """Where training stands: what the loop needs to continue exactly."""

    iteration: int = 0
    consumed_samples: int = 0  # samples read (the data position)
    scheduled_samples: int = 0  # samples of successful updates (the LR schedule's clock)
    evaluations: dict[str, int] | None = None  # evaluations run per split (their data position)
    # The LR schedule's settings under Megatron's names (scheduler_rule.SETTINGS); None: none
    # recorded (a checkpoint from before they were, or no schedule).
    scheduler: dict[str, object] | None = None

    def as_dict(self) -> dict:
        """torch_dist's common entries: the progress, and Megatron's `opt_param_scheduler`
        (the settings and the clock, num_steps) when there are settings."""
        entries: dict = {
            "iteration": self.iteration,
            "consumed_train_samples": self.consumed_samples,
            "scheduled_samples": self.scheduled_samples,
            "evaluations": dict(self.evaluations or {}),
        }
        if self.scheduler is not None:
            entries["opt_param_scheduler"] = {
                **self.scheduler,
                "num_steps": self.scheduled_samples,
            }
        return entries

    def scheduler_entry(self) -> dict:
        """The legacy format's `opt_param_scheduler`: Megatron's settings and num_steps, and
        megapipe's progress beside them (one flat dict, as Megatron's loader reads it)."""
        entries = self.as_dict()
        return {**entries.pop("opt_param_scheduler", {}), **entries}

    @classmethod
    def from_dict(cls, common: dict) -> Progress:
        """From torch_dist's common entries, or the legacy `opt_param_scheduler` entry."""
        return cls(
            int(common["iteration"]),
            int(common["consumed_train_samples"]),
            int(common["scheduled_samples"]),
            {k: int(v) for k, v in common.get("evaluations", {}).items()},
            saved_settings(common.get("opt_param_scheduler", common)),
        )


def layout_of(state: ParallelState, virtual_stages: int) -> dict[str, int]:
    layout = {
        "world_size": state.world_size,
        "tensor_model_parallel_size": state.tp.size,
        "pipeline_model_parallel_size": state.pp.size,
        "virtual_pipeline_model_parallel_size": virtual_stages,
    }
    if state.cp.size > 1:  # left out at CP 1: the layouts of checkpoints written before CP
        layout["context_parallel_size"] = state.cp.size
    return layout


@dataclass(frozen=True)
class LiveRun:
    """The parts of a running job that a checkpoint saves and restores, in any format."""

    state: ParallelState
    chunks: list[torch.nn.Module]  # this rank's model chunks (virtual stages)
    optimizer: ShardedOptimizer
    rng: RNGTracker
    layout: dict[str, int]  # `layout_of` this run


def _named_params(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    return [item for chunk in chunks for item in chunk.named_parameters()]


def _checkpointed(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Parameters and checkpointed buffers (routers' expert biases)."""
    return [item for chunk in chunks for item in checkpointed_tensors(chunk)]


def _writes_experts(state: ParallelState) -> bool:
    """Expert parameters (split over EP) are written by every EP rank of the first expert-
    data-parallel replica (at EP 1: the model's writer, DP x CP rank 0)."""
    return state.ep.size > 1 and state.expert_dp.rank == 0 and _first_replica(state)


def _names(chunks: Sequence[torch.nn.Module]) -> dict[int, str]:
    return {id(p): n for n, p in _named_params(chunks)}


def _optimizer_pieces(optimizer: ShardedOptimizer, names: dict[int, str]) -> list[tuple]:
    pieces = []
    for piece, master in zip(optimizer.pieces, optimizer.masters):
        state = optimizer.inner.state.get(master, {})
        moments = {k: state[k] for k in OPTIMIZER_STATES if k in state}
        pieces.append((names[id(piece.param)], piece.param, piece.start, master, moments))
    return pieces


def _writes_optimizer(optimizer: ShardedOptimizer, state: ParallelState) -> bool:
    """Sharded: every rank of the first replica its shard (shards are split over DP x CP);
    else the first rank of DP x CP, whose ranks all hold the same whole optimizer state."""
    return (optimizer.sharded and _first_replica(state)) or state.dp_cp.rank == 0


def _first_replica(state: ParallelState) -> bool:
    """Hybrid sharding writes each shard from the first of its replicas only."""
    return state.dp_outer is None or state.dp_outer.rank == 0


def _writes_model(optimizer: ShardedOptimizer | None, state: ParallelState) -> bool:
    """DP x CP rank 0 holds the whole model (CP ranks hold the same parameters as DP
    replicas), except under FSDP2, where each rank of DP x CP holds its rows."""
    if optimizer is not None and optimizer.masters_are_weights:
        return _first_replica(state)
    return state.dp_cp.rank == 0


def ensure_optimizer_state(optimizer: ShardedOptimizer) -> None:
    """Create the optimizer's per-master state (zeros) as its first step would, so a loaded
    checkpoint has tensors to fill. A no-op once the optimizer has stepped."""
    inner = optimizer.inner
    fused = bool(inner.defaults.get("fused"))
    for master in optimizer.masters:
        state = inner.state[master]
        if state:
            continue
        if isinstance(inner, torch.optim.AdamW):
            device = master.device if fused else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        elif inner.defaults.get("momentum", 0) != 0:
            state["momentum_buffer"] = torch.zeros_like(master)


def optimizer_step_count(optimizer: ShardedOptimizer) -> int:
    for master in optimizer.masters:
        step = optimizer.inner.state.get(master, {}).get("step")
        if step is not None:
            return int(step)
    return 0


def _set_step_count(optimizer: ShardedOptimizer, count: int) -> None:
    for master in optimizer.masters:
        step = optimizer.inner.state.get(master, {}).get("step")
        if step is not None:
            step.fill_(float(count))


def rng_key(rank: int, what: str) -> str:
    return f"rng_state.rank_{rank:05d}.{what}"


def _rng_tensors(tracker: RNGTracker) -> dict[str, torch.Tensor]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    tensors = {
        "python": torch.tensor([version, *internal, -1 if gauss is None else 0], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    tracked = tracker.state_dict()
    tensors["tracker_default"] = tracked["default"].clone()
    tensors["tracker_tensor_parallel"] = tracked["tensor_parallel"].clone()
    return tensors


def rng_shards(tracker: RNGTracker, state: ParallelState) -> ShardedState:
    """This rank's random states, each a whole tensor under a rank-specific name."""
    return {
        rng_key(state.rank, what): [TensorShard(t, (0,) * t.dim(), tuple(t.shape))]
        for what, t in _rng_tensors(tracker).items()
    }


def restore_rng(loaded: dict[str, torch.Tensor], tracker: RNGTracker, rank: int) -> None:
    """Put back the random states `rng_shards` saved for `rank` (read into `loaded`)."""
    python = loaded[rng_key(rank, "python")].tolist()
    gauss_flag = python[-1]
    gauss = None if gauss_flag == -1 else float(loaded[rng_key(rank, "python_gauss")][0])
    random.setstate((python[0], tuple(python[1:-1]), gauss))
    pos, has_gauss = loaded[rng_key(rank, "numpy_pos")].tolist()
    np.random.set_state(
        (
            "MT19937",
            loaded[rng_key(rank, "numpy")].numpy().astype(np.uint32),
            pos,
            has_gauss,
            float(loaded[rng_key(rank, "numpy_gauss")][0]),
        )
    )
    torch.set_rng_state(loaded[rng_key(rank, "torch_cpu")])
    tracker.load_state_dict(
        {
            "default": loaded[rng_key(rank, "tracker_default")],
            "tensor_parallel": loaded[rng_key(rank, "tracker_tensor_parallel")],
        }
    )


def rng_destinations(tracker: RNGTracker, state: ParallelState) -> ShardedState:
    """Empty tensors of the right shapes to read this rank's saved random states into."""
    return {
        key: [TensorShard(torch.empty_like(s.tensor), s.offsets, s.global_shape) for s in shards]
        for key, shards in rng_shards(tracker, state).items()
    }


def state_to_save(
    chunks: Sequence[torch.nn.Module],
    optimizer: ShardedOptimizer | None,
    state: ParallelState,
    num_layers: int,
    *,
    model_owner: ShardedOptimizer | None = None,
    stacked: bool = True,
) -> ShardedState:
    """The model (and, unless `optimizer` is None, the optimizer) pieces this rank writes.
    `model_owner`: the run's optimizer even when its state is not saved, which says who holds
    the weights (FSDP2: every rank its rows) and their dtype. `stacked`: `stacks_layers`."""
    model_owner = model_owner or optimizer
    shards: ShardedState = {}
    places = _places(state, stacked)
    named = _checkpointed(chunks)
    if not _writes_model(model_owner, state):
        named = [item for item in named if is_expert(item[1])] if _writes_experts(state) else []
    if state.dp_cp.rank != 0:  # buffers are whole on every rank, FSDP2's too: written once
        named = [item for item in named if isinstance(item[1], torch.nn.Parameter)]
    if named:
        dtype = model_owner.config.params_dtype if model_owner is not None else None
        shards.update(model_shards(named, state.tp.rank, state.tp.size, num_layers, dtype=dtype,
                                   **places))  # fmt: skip
    if optimizer is not None:
        if _writes_optimizer(optimizer, state):
            _add_optimizer(shards, chunks, optimizer, state, num_layers, loading=False, **places)
        elif _writes_experts(state) and not optimizer.sharded:
            _add_optimizer(shards, chunks, optimizer, state, num_layers, loading=False,
                           experts_only=True, **places)  # fmt: skip
    return shards


def _places(state: ParallelState, stacked: bool) -> dict:
    return {"ep_rank": state.ep.rank, "ep_size": state.ep.size, "stacked": stacked}


def extra_state_to_save(
    chunks: Sequence[torch.nn.Module],
    state: ParallelState,
    num_layers: int,
    *,
    stacked: bool = True,
) -> dict[str, bytes]:
    """Megatron-Core's `_extra_state` entries of this rank's layers (every expert's included),
    written once over the job: by TP rank 0 of data-parallel (x context-parallel) rank 0 (of
    the first replica, under hybrid sharding)."""
    if state.tp.rank != 0 or state.dp_cp.rank != 0 or not _first_replica(state):
        return {}
    return extra_state_entries(layer_mlps(_named_params(chunks)), num_layers, stacked=stacked)


def _add_optimizer(
    shards: ShardedState,
    chunks: Sequence[torch.nn.Module],
    optimizer: ShardedOptimizer,
    state: ParallelState,
    num_layers: int,
    *,
    loading: bool,
    experts_only: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    stacked: bool = True,
) -> None:
    pieces = _optimizer_pieces(optimizer, _names(chunks))
    if experts_only:
        pieces = [piece for piece in pieces if is_expert(piece[1])]
    found = optimizer_shards(
        pieces,
        state.tp.rank,
        state.tp.size,
        num_layers,
        include_masters=optimizer.saves_masters,
        loading=loading,
        ep_rank=ep_rank,
        ep_size=ep_size,
        stacked=stacked,
    )
    for key, more in found.items():
        shards.setdefault(key, []).extend(more)


def state_to_load(
    chunks: Sequence[torch.nn.Module],
    optimizer: ShardedOptimizer | None,
    state: ParallelState,
    num_layers: int,
    *,
    stacked: bool = True,
) -> ShardedState:
    """Every piece this rank must fill: its parameters (replicas and mirrors included, and the
    routers' expert biases) and, unless `optimizer` is None, the optimizer state of the part
    of them it optimizes."""
    places = _places(state, stacked)
    named = _checkpointed(chunks)
    shards = model_shards(named, state.tp.rank, state.tp.size, num_layers, loading=True, **places)
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
        _add_optimizer(shards, chunks, optimizer, state, num_layers, loading=True, **places)
    return shards


def after_load(optimizer: ShardedOptimizer, step_count: int | None, masters_loaded: bool) -> None:
    """Make the optimizer consistent with freshly loaded weights: masters from the weights when
    the checkpoint had none for them, and the step count Adam's bias correction needs."""
    if not masters_loaded:
        optimizer.masters_from_weights()
    if step_count is not None:
        _set_step_count(optimizer, step_count)
