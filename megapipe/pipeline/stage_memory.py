"""Memory per pipeline stage: parameters, gradients, optimizer state and peak activations.

Stages differ in memory even with equal layer counts: in 1F1B, stage i keeps up to min(p - i,
m) micro-batches in flight (the simulator counts them for any schedule), the first stage holds
the word (and position) embeddings and the last the final norm, the output layer and the loss.
This module estimates each stage's bytes from the configs alone (before any model exists), so
rank 0 can print the table at start-up and `--pipeline-partition memory` can choose layer
counts that even it out.

Bytes per parameter (`bytes_per_parameter`, by the data-parallel sharding strategy, over a
shard group of d = DP / --num-distributed-optimizer-instances ranks; Adam, fp32 | bf16):

| strategy                    | params | grads | optimizer state   | at rest: fp32 | bf16       |
|-----------------------------|--------|-------|-------------------|---------------|------------|
| no_shard                    | 4 / 2  | 4     | 8 / 4 + 8         | 16            | 18         |
| optim (ZeRO-1)              | 4 / 2  | 4     | 8/d / (4 + 8)/d   | 8 + 8/d       | 6 + 12/d   |
| optim_grads (ZeRO-2)        | 4/d    | 4/d   | 8/d               | 16/d          | 16/d       |
| optim_grads_params (ZeRO-3) | 4/d    | 4/d   | 8/d               | 16/d          | 16/d       |

(bf16: the optimizer state includes the fp32 master copy; under FSDP2 the fp32 shards are the
masters.) Under FSDP2 (distributed/fsdp.py) ZeRO-2 and ZeRO-3 both keep the parameters sharded
between steps; they differ in how many are gathered, in the training dtype, while the step
runs (`gathered_parameter_bytes`): ZeRO-2 every layer of the stage from its forward to its
backward (fp32: a peak of about 4 + 16/d, Megatron's 4 + 12/d plus the fp32 shard), ZeRO-3
the chunk's root group (embedding, final norm, output layer: gathered through the chunk's
whole forward and backward) and one layer, each plus about one layer's all-gather buffer.
A shard group of one rank runs the plain path (no_shard's numbers). Activations per micro-batch:
`model/activation_memory.layer_activation_bytes` per layer (recomputation included), plus
on the last stage the final norm's and output layer's inputs and the fp32 logits (twice
under TP: the vocabulary-parallel cross-entropy keeps its own copy). The numbers are per
rank of a stage (TP-sharded). Under context parallelism a rank holds S / CP tokens of each
sequence, so its activations are the formula's at S / CP (plus what the comm type keeps:
`activation_memory.py`), and the shard group above is DP x CP ranks.

Mixtures of experts (`stage_parameters.py`): an MoE layer's rank holds E / EP experts; their
bytes per parameter follow the table over the expert-DP ranks (d = DP x CP / EP) while the
dense parameters' use DP x CP, and its activations are `activation_memory_moe`'s (the
router, the experts' rows, the combine; balanced routing under EP). Stages are costed by the
global layers they hold, so with --moe-layer-freq a stage of MoE layers weighs its experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megapipe.config import (
    Configs,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
)
from megapipe.model.activation_memory import layer_activation_bytes
from megapipe.model.attention_backends import attention_dropout_rng
from megapipe.pipeline.partition import StageMap, partition_layers
from megapipe.pipeline.schedules import ZERO_BUBBLE_KINDS
from megapipe.pipeline.simulator import simulate_kind
from megapipe.pipeline.stage_parameters import (  # noqa: F401 (re-exported)
    _indices,
    bytes_per_parameter,
    fsdp_shards,
    layer_expert_parameters,
    layer_parameters,
    sharded_over,
    stage_expert_parameters,
    stage_parameters,
    training_dtype_bytes,
)

_MB = 1024.0 * 1024.0


def gathered_parameter_bytes(
    config: ModelConfig,
    optimizer: OptimizerConfig,
    dp: int,
    layers: int,
    first: bool,
    last: bool,
    tp: int,
    *,
    whole_stage: bool = False,
    ep: int = 1,
) -> int:
    """Peak bytes FSDP2 holds gathered on one rank of a stage of `layers` layers, on top of the
    shards, in the training dtype (0 without FSDP2): the gathered parameters, and the flat
    all-gather buffer of the last group gathered (forward frees it at the next group's
    copy-out, so for a moment it sits beside the next group's buffer). Measured on torch
    2.13 (tests/test_stage_memory.py): the chunk's root group (embedding / final norm / output
    layer, gathered for the chunk's whole forward and backward) plus the larger of (its
    buffer + the first layer's) and (the layers gathered + one layer's buffer): under ZeRO-2
    every layer stays gathered, under ZeRO-3 one (and one more buffer when
    --overlap-param-gather prefetches the next layer in forward). `whole_stage`: a zero-bubble
    schedule, whose step keeps every layer gathered until its last W (ZeRO-2's count under
    either strategy; `distributed/fsdp.reduce_after_step`). Not counted: the unsharded
    gradients of the group in backward and the reduce-scatter buffers (about a layer)."""
    if not fsdp_shards(optimizer, dp):
        return 0
    layer = layer_parameters(config, tp, 0, ep)  # (layer 0 is an MoE layer in an MoE model)
    root = stage_parameters(config, 0, first, last, tp)
    if optimizer.sharding == "optim_grads" or whole_stage:
        held = layers + min(layers, 1)
    else:
        prefetch = 1 if optimizer.overlap_param_gather and layers > 1 else 0
        held = min(layers, 1) * 2 + prefetch
    count = root + max(root + min(layers, 1) * layer, held * layer)
    return count * training_dtype_bytes(optimizer)


def head_activation_bytes(
    config: ModelConfig, micro_batch: int, tp: int, sp: bool, dtype_bytes: int, cp: int = 1
) -> int:
    """The last stage's extra activations per micro-batch: the final norm's and the output
    layer's inputs and the fp32 logits (twice under TP), over this rank's S / cp tokens."""
    s, b, h = config.seq_length // cp, micro_batch, config.hidden_size
    local_s = s // tp if sp and tp > 1 else s
    norm = local_s * b * h * dtype_bytes + local_s * b * 4 * 2
    logits = s * b * config.padded_vocab_size(tp) // tp * 4
    return norm + local_s * b * h * dtype_bytes + logits * (2 if tp > 1 else 1)


def stage_activation_bytes(
    config: ModelConfig,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputeConfig,
    layers: int | Sequence[int],
    first: bool,
    last: bool,
    dtype_bytes: int,
    attention_dropout_fused: bool = False,
    cp: int = 1,
    cp_comm_type: str = "p2p",
    ep: int = 1,
    moe_dispatcher: str = "alltoall",
) -> int:
    """Activations one micro-batch leaves on a stage of `layers` layers (a count: layers
    0..n-1; or their global indices) until its backward (under context parallelism, for this
    rank's S / cp tokens of each sequence; MoE layers with their experts' rows, under expert
    parallelism as `activation_memory_moe` models it)."""
    indices = _indices(layers)
    count = len(indices)
    partial = 0
    kept: Sequence[int] = indices
    if recompute.full:
        n = recompute.num_layers or 1
        block = recompute.method == "block"
        partial = min(n, count) if block else math.ceil(count / n)
        kept = indices[min(n, count) :] if block else ()
    moe_kept = sum(1 for i in kept if config.is_moe_layer(i))

    def layer_bytes(moe: bool) -> int:
        index = _first_layer(config, moe)
        return layer_activation_bytes(
            config, micro_batch, tp, sequence_parallel=sp, dtype_bytes=dtype_bytes,
            recompute=RecomputeConfig() if recompute.full else recompute,
            attention_dropout_fused=attention_dropout_fused, cp=cp, cp_comm_type=cp_comm_type,
            layer=index, ep=ep, moe_dispatcher=moe_dispatcher,
        )  # fmt: skip

    total = (len(kept) - moe_kept) * layer_bytes(False) if len(kept) > moe_kept else 0
    total += moe_kept * layer_bytes(True) if moe_kept else 0
    group_input = layer_activation_bytes(
        config, micro_batch, tp, sequence_parallel=sp, dtype_bytes=dtype_bytes,
        recompute=RecomputeConfig("full", "uniform", 1), cp=cp,
    )  # fmt: skip
    head = head_activation_bytes(config, micro_batch, tp, sp, dtype_bytes, cp) if last else 0
    if first and config.hidden_dropout > 0:  # the embedding dropout's keep-mask
        local_s = config.seq_length // cp // (tp if sp and tp > 1 else 1)
        head += local_s * micro_batch * config.hidden_size * dtype_bytes
    return total + partial * group_input + head


def _first_layer(config: ModelConfig, moe: bool) -> int:
    """The first global layer index that is (moe) or is not an MoE layer (0 if none is)."""
    return next((i for i in range(config.num_layers) if config.is_moe_layer(i) == moe), 0)


@dataclass(frozen=True)
class StageMemory:
    """One stage's estimated bytes per rank."""

    stage: int
    layers: int
    parameters: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # peak: per micro-batch x micro-batches in flight
    in_flight: int
    gathered_bytes: float = 0.0  # FSDP2's parameters gathered during the step (ZeRO-2/3)
    expert_parameters: int = 0  # of `parameters`: E / EP experts per MoE layer

    @property
    def total_bytes(self) -> float:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.gathered_bytes
        )


@dataclass(frozen=True)
class MemoryModel:
    """Everything the estimate needs, so it can be evaluated for any layer counts."""

    config: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    recompute: RecomputeConfig
    micro_batch_size: int
    num_microbatches: int
    data_parallel_size: int
    # attention dropout inside the fused kernel (no s x s activations): --attention-dropout-rng
    # fused, the default on CUDA; False for the layout-invariant masks' unfused attention
    attention_dropout_fused: bool = False

    @classmethod
    def of(cls, configs: Configs, device_type: str = "cpu") -> MemoryModel:
        """The estimate for a run's settled configs, on a device of `device_type`."""
        dp, training = configs.data_parallel_size, configs.training
        mode = attention_dropout_rng(configs.kernels.attention_dropout_rng, device_type)
        return cls(configs.model, configs.parallel, configs.optimizer, configs.recompute,
                   training.micro_batch_size, training.num_microbatches(dp), dp,
                   attention_dropout_fused=mode == "fused")  # fmt: skip

    @property
    def shard_ranks(self) -> int:
        """The ranks optimizer state, gradients and (ZeRO-3) parameters shard over: DP x CP
        (context-parallel ranks hold the same parameters and reduce gradients together)."""
        return self.data_parallel_size * self.parallel.context_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        """EP: the ranks of each DP x CP group that split every MoE layer's experts."""
        return self.parallel.expert_model_parallel_size

    @property
    def moe_dispatcher(self) -> str:
        """How tokens reach their experts under EP (alltoall or allgather)."""
        moe = self.config.moe
        return moe.moe_token_dispatcher_type if moe is not None else "alltoall"

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks expert parameters' gradients and state shard over: expert-DP, the
        DP x CP ranks holding the same experts (DP x CP / EP)."""
        return max(1, self.shard_ranks // self.expert_model_parallel_size)

    def in_flight(self) -> list[int]:
        """Peak micro-batches (chunk forwards) each pipeline rank holds, from the simulator."""
        parallel = self.parallel
        p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
        if p == 1:
            return [1]
        return simulate_kind(parallel.schedule, p, v, self.num_microbatches).peak_in_flight

    def stage(
        self,
        index: int,
        chunks: Sequence[int | Sequence[int]],
        in_flight: int,
        recompute: RecomputeConfig | None = None,
    ) -> StageMemory:
        """Pipeline rank `index` holding these model chunks: ranges of global layer indices, or
        layer counts (read as layers 0, 1, ...: exact for models whose layers are alike).
        Activations: the peak chunk forwards in flight times the chunks' mean per micro-batch.
        Expert parameters count E / EP experts per MoE layer, their gradients and optimizer
        state sharded over the expert-DP ranks (DP x CP / EP)."""
        p = self.parallel.pipeline_model_parallel_size
        tp, sp = self.parallel.tensor_model_parallel_size, self.parallel.sequence_parallel
        ep = self.expert_model_parallel_size
        first, last = index == 0, index == p - 1
        if all(isinstance(c, int) for c in chunks):
            chunks = _consecutive(chunks)  # type: ignore[arg-type]
        indices = [i for chunk in chunks for i in chunk]  # type: ignore[union-attr]
        layers = len(indices)
        count = stage_parameters(self.config, indices, first, last, tp, ep)
        experts = stage_expert_parameters(self.config, indices, tp, ep)
        param, grad, state = bytes_per_parameter(self.optimizer, self.shard_ranks)
        e_param, e_grad, e_state = bytes_per_parameter(self.optimizer, self.expert_shard_ranks)
        dense = count - experts
        dtype_bytes = training_dtype_bytes(self.optimizer)
        gathered = gathered_parameter_bytes(
            self.config, self.optimizer, self.shard_ranks, layers, first, last, tp,
            whole_stage=self.parallel.schedule in ZERO_BUBBLE_KINDS, ep=ep,
        )  # fmt: skip
        recompute = recompute or self.recompute  # the memory partition's choice, or the flags'
        per_chunk = [
            stage_activation_bytes(
                self.config,
                self.micro_batch_size,
                tp,
                sp,
                recompute,
                chunk,  # type: ignore[arg-type]
                first and c == 0,
                last and c == len(chunks) - 1,
                dtype_bytes,
                self.attention_dropout_fused,
                self.parallel.context_parallel_size,
                self.parallel.cp_comm_type,
                ep,
                self.moe_dispatcher,
            )
            for c, chunk in enumerate(chunks)
        ]
        activations = sum(per_chunk) / len(per_chunk) * in_flight
        return StageMemory(index, layers, count, dense * param + experts * e_param,
                           dense * grad + experts * e_grad, dense * state + experts * e_state,
                           activations, in_flight, gathered, experts)  # fmt: skip

    def stages(self, stage_map: StageMap) -> list[StageMemory]:
        """The estimate for every pipeline rank of `stage_map`."""
        flights = self.in_flight()
        recompute = stage_map.recompute or (self.recompute,) * stage_map.pipeline_size
        return [
            self.stage(rank, list(chunks), flights[rank], recompute[rank])
            for rank, chunks in enumerate(stage_map.layers)
        ]

    def stage_bytes(self) -> Callable[[int, int | range], float]:
        """(stage, layers: a range of global indices, or a count) -> total bytes, for the
        memory partition. Cached by the layer count and how many of them are MoE layers, the
        only things a stage's bytes depend on."""
        flights, cache = self.in_flight(), {}
        moe_before = [0]  # moe_before[i]: MoE layers among layers 0..i-1
        for i in range(self.config.num_layers):
            moe_before.append(moe_before[-1] + self.config.is_moe_layer(i))

        def total(index: int, layers: int | range) -> float:
            chunk = range(layers) if isinstance(layers, int) else layers
            key = (index, len(chunk), moe_before[chunk.stop] - moe_before[chunk.start])
            if key not in cache:
                cache[key] = self.stage(index, [chunk], flights[index]).total_bytes
            return cache[key]

        return total


def _consecutive(counts: Sequence[int]) -> list[range]:
    """Layer counts as consecutive ranges from layer 0."""
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def deviation(stages: list[StageMemory]) -> float:
    """The largest relative distance of a stage's total from the mean."""
    totals = [s.total_bytes for s in stages]
    mean = sum(totals) / len(totals)
    return max(abs(t - mean) for t in totals) / mean


def describe(stages: list[StageMemory], measured: list[float | None] | None = None) -> str:
    """The per-stage table rank 0 prints (MiB per rank of the stage)."""
    header = (
        "memory per pipeline stage (MiB per rank, estimated): stage | layers | parameters | "
        "params | grads | optimizer | activations (in flight) | total"
    )
    gathered = any(s.gathered_bytes for s in stages)
    if gathered:
        header = header.replace("| total", "| gathered params | total")
    lines = [header]
    for i, s in enumerate(stages):
        line = (
            f"  {s.stage:5d} | {s.layers:6d} | {s.parameters:10d} | "
            f"{s.parameter_bytes / _MB:8.1f} | {s.gradient_bytes / _MB:8.1f} | "
            f"{s.optimizer_bytes / _MB:9.1f} | "
            f"{s.activation_bytes / _MB:8.1f} ({s.in_flight}) | "
            + (f"{s.gathered_bytes / _MB:15.1f} | " if gathered else "")
            + f"{s.total_bytes / _MB:8.1f}"
        )
        if measured is not None and measured[i] is not None:
            line += f" | measured activations {measured[i] / _MB:.1f}"
        lines.append(line)
    lines.append(f"  largest deviation of a stage's total from the mean: {deviation(stages):.1%}")
    return "\n".join(lines)


BALANCED = 0.15  # the memory partition's aim: every stage within 15% of the mean


def recompute_ladder(layers: int, moe: bool = False) -> list[RecomputeConfig]:
    """A stage's recomputation options, keeping ever less: none, selective core_attn,
    selective core_attn + mlp, then full recomputation of its first 1, 2, ... layers. With
    mixtures of experts only the first two (MoE layers refuse MLP and full recomputation)."""
    ladder = [RecomputeConfig(), RecomputeConfig("selective", modules=("core_attn",))]
    if moe:
        return ladder
    return [
        *ladder,
        RecomputeConfig("selective", modules=("core_attn", "mlp")),
        *(RecomputeConfig("full", "block", n) for n in range(1, layers + 1)),
    ]


def recompute_to_balance(model: MemoryModel, counts: list[int]) -> tuple[RecomputeConfig, ...]:
    """Per-stage recomputation that evens out what layer counts alone cannot: while the
    deviation is at least BALANCED, move the stage whose next rung of `recompute_ladder`
    lowers the deviation most one rung up; stop when no move helps. () when none is needed."""
    flights = model.in_flight()
    ladders = [recompute_ladder(n, model.config.moe is not None) for n in counts]
    ranges = _consecutive(counts)
    rungs = [0] * len(counts)

    def deviation_at(trial: list[int]) -> float:
        return deviation([model.stage(i, [r], flights[i], ladders[i][trial[i]])
                          for i, r in enumerate(ranges)])  # fmt: skip

    current = deviation_at(rungs)
    while current >= BALANCED:
        moves = []
        for i in range(len(counts)):
            if rungs[i] + 1 < len(ladders[i]):
                trial = rungs[:i] + [rungs[i] + 1] + rungs[i + 1 :]
                moves.append((deviation_at(trial), trial))
        if not moves or min(moves)[0] >= current:
            break
        current, rungs = min(moves)
    if not any(rungs):
        return ()
    return tuple(ladders[i][r] for i, r in enumerate(rungs))


def measured_line(rank: int, estimate: StageMemory, saved_peak: int, device) -> str:
    """After the first iteration: this stage's measured peak next to the estimate (CUDA: the
    allocator's max allocated against the total; CPU: the peak saved-activation bytes)."""
    import torch

    where = f"[Rank {rank}] pipeline stage {estimate.stage} after 1 iteration:"
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        return (f"{where} max allocated {allocated / _MB:.1f} MiB (estimate "
                f"{estimate.total_bytes / _MB:.1f} MiB)")  # fmt: skip
    return (f"{where} peak saved activations {saved_peak / _MB:.2f} MiB (estimate "
            f"{estimate.activation_bytes / _MB:.2f} MiB)")  # fmt: skip


def plan_stages(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    optimizer: OptimizerConfig,
    recompute: RecomputeConfig,
    data_parallel_size: int,
) -> StageMap:
    """The run's stage map by --pipeline-partition (memory: from this module's estimate)."""
    stage_bytes = None
    if parallel.pipeline_partition == "memory":
        estimate = MemoryModel(model, parallel, optimizer, recompute, micro_batch_size,
                               num_microbatches, data_parallel_size)  # fmt: skip
        stage_bytes = estimate.stage_bytes()
    stage_map = partition_layers(
        model,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        method=parallel.pipeline_partition,
        first=parallel.decoder_first_pipeline_num_layers,
        last=parallel.decoder_last_pipeline_num_layers,
        stage_bytes=stage_bytes,
    )
    if stage_bytes is not None and recompute.granularity is None:  # the flags leave it to us
        counts = [len(chunks[0]) for chunks in stage_map.layers]
        stage_map = dataclasses.replace(stage_map, recompute=recompute_to_balance(estimate, counts))
    return stage_map
