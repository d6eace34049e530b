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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
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

_MB = 1024.0 * 1024.0


def layer_parameters(config: ModelConfig, tp: int, layer: int = 0) -> int:
    """Parameters of transformer layer `layer` (global index) on one TP rank: an MoE layer
    holds its router, every expert (no expert parallelism yet) and the shared expert."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d
    weights = (h * qkv + config.num_attention_heads * d * h) // tp
    biases = qkv // tp + h if config.add_bias_linear else 0
    norms = 2 * h * (2 if config.normalization == "LayerNorm" else 1)
    if config.qk_layernorm:  # q and k norms over the head dim, replicated across TP
        norms += 2 * d * (2 if config.normalization == "LayerNorm" else 1)
    if config.is_moe_layer(layer):
        moe = config.moe
        mlp = moe.num_experts * _mlp_parameters(config, config.moe_ffn_hidden_size, tp)
        mlp += moe.num_experts * h  # the router, replicated over TP
        if moe.moe_shared_expert_intermediate_size is not None:
            mlp += _mlp_parameters(config, moe.moe_shared_expert_intermediate_size, tp)
    else:
        mlp = _mlp_parameters(config, f, tp)
    return weights + biases + norms + mlp


def _mlp_parameters(config: ModelConfig, ffn: int, tp: int) -> int:
    """One MLP of ffn size `ffn` on one TP rank (fc1 and its bias split, fc2's bias whole)."""
    h = config.hidden_size
    fc1 = ffn * (2 if config.swiglu else 1)
    biases = fc1 // tp + h if config.add_bias_linear else 0
    return (h * fc1 + ffn * h) // tp + biases


def stage_parameters(
    config: ModelConfig, layers: int | range, first: bool, last: bool, tp: int
) -> int:
    """Parameters one TP rank of a stage holds: its layers (a range of global indices, or a
    count, read as layers 0..count-1), and the embedding / output layer (with tied embeddings
    a last stage that is not also the first holds a copy)."""
    h, vocab = config.hidden_size, config.padded_vocab_size(tp)
    indices = range(layers) if isinstance(layers, int) else layers
    count = sum(layer_parameters(config, tp, i) for i in indices)
    if first:
        count += vocab * h // tp
        if config.position_embedding_type == "learned_absolute":
            count += config.max_position_embeddings * h
    if last:
        count += h * (2 if config.normalization == "LayerNorm" else 1)
        tied = not config.untie_embeddings_and_output_weights
        if not (tied and first):
            count += vocab * h // tp
    return count


def sharded_over(optimizer: OptimizerConfig, dp: int) -> int:
    """Ranks one parameter's state is sharded over: DP, or DP / N with hybrid sharding."""
    return max(1, dp // max(1, optimizer.num_distributed_optimizer_instances))


def fsdp_shards(optimizer: OptimizerConfig, dp: int) -> bool:
    """Whether FSDP2 shards this run (ZeRO-2/3 over more than one rank; else the plain path)."""
    return optimizer.fsdp and sharded_over(optimizer, dp) > 1


def training_dtype_bytes(optimizer: OptimizerConfig) -> int:
    return 2 if optimizer.bf16 or optimizer.fp16 else 4


def bytes_per_parameter(optimizer: OptimizerConfig, dp: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes per parameter on one rank at rest (between
    steps, gradients still held), by `optimizer.sharding` (the module docstring's table). The
    optimizer state includes the fp32 master copy where there is a separate one."""
    d = sharded_over(optimizer, dp)
    param = training_dtype_bytes(optimizer)
    states = 2 if optimizer.optimizer == "adam" else (1 if optimizer.sgd_momentum else 0)
    if fsdp_shards(optimizer, dp):  # fp32 shards are the masters; fp32 sharded gradients
        return 4 / d, 4 / d, 4 * states / d
    state = 4 * states + (4 if param == 2 else 0)
    return param, 4, state / (d if optimizer.sharding == "optim" else 1)


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
    layer = layer_parameters(config, tp)
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
    layers: int,
    first: bool,
    last: bool,
    dtype_bytes: int,
    attention_dropout_fused: bool = False,
    cp: int = 1,
    cp_comm_type: str = "p2p",
) -> int:
    """Activations one micro-batch leaves on a stage of `layers` layers until its backward
    (under context parallelism, for this rank's S / cp tokens of each sequence)."""
    kept = partial = 0
    if recompute.full:
        n = recompute.num_layers or 1
        groups = min(n, layers) if recompute.method == "block" else math.ceil(layers / n)
        kept = layers - min(n, layers) if recompute.method == "block" else 0
        partial = groups
    else:
        kept = layers
    full_layer = layer_activation_bytes(
        config, micro_batch, tp, sequence_parallel=sp, dtype_bytes=dtype_bytes,
        recompute=RecomputeConfig() if recompute.full else recompute,
        attention_dropout_fused=attention_dropout_fused, cp=cp, cp_comm_type=cp_comm_type,
    )  # fmt: skip
    group_input = layer_activation_bytes(
        config, micro_batch, tp, sequence_parallel=sp, dtype_bytes=dtype_bytes,
        recompute=RecomputeConfig("full", "uniform", 1), cp=cp,
    )  # fmt: skip
    head = head_activation_bytes(config, micro_batch, tp, sp, dtype_bytes, cp) if last else 0
    if first and config.hidden_dropout > 0:  # the embedding dropout's keep-mask
        local_s = config.seq_length // cp // (tp if sp and tp > 1 else 1)
        head += local_s * micro_batch * config.hidden_size * dtype_bytes
    return kept * full_layer + partial * group_input + head


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
        chunks: list[int],
        in_flight: int,
        recompute: RecomputeConfig | None = None,
    ) -> StageMemory:
        """Pipeline rank `index` holding model chunks of these layer counts. Activations: the
        peak chunk forwards in flight times the chunks' mean activations per micro-batch."""
        p = self.parallel.pipeline_model_parallel_size
        tp, sp = self.parallel.tensor_model_parallel_size, self.parallel.sequence_parallel
        first, last = index == 0, index == p - 1
        layers = sum(chunks)
        count = stage_parameters(self.config, layers, first, last, tp)
        param, grad, state = bytes_per_parameter(self.optimizer, self.shard_ranks)
        dtype_bytes = training_dtype_bytes(self.optimizer)
        gathered = gathered_parameter_bytes(
            self.config, self.optimizer, self.shard_ranks, layers, first, last, tp,
            whole_stage=self.parallel.schedule in ZERO_BUBBLE_KINDS,
        )  # fmt: skip
        recompute = recompute or self.recompute  # the memory partition's choice, or the flags'
        per_chunk = [
            stage_activation_bytes(
                self.config,
                self.micro_batch_size,
                tp,
                sp,
                recompute,
                n,
                first and c == 0,
                last and c == len(chunks) - 1,
                dtype_bytes,
                self.attention_dropout_fused,
                self.parallel.context_parallel_size,
                self.parallel.cp_comm_type,
            )
            for c, n in enumerate(chunks)
        ]
        activations = sum(per_chunk) / len(per_chunk) * in_flight
        return StageMemory(index, layers, count, count * param, count * grad, count * state,
                           activations, in_flight, gathered)  # fmt: skip

    def stages(self, stage_map: StageMap) -> list[StageMemory]:
        """The estimate for every pipeline rank of `stage_map`."""
        flights = self.in_flight()
        recompute = stage_map.recompute or (self.recompute,) * stage_map.pipeline_size
        return [
            self.stage(rank, [len(chunk) for chunk in chunks], flights[rank], recompute[rank])
            for rank, chunks in enumerate(stage_map.layers)
        ]

    def stage_bytes(self) -> Callable[[int, int], float]:
        """(stage, layers) -> total bytes, for the memory partition."""
        flights = self.in_flight()
        return lambda index, layers: self.stage(index, [layers], flights[index]).total_bytes


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


def recompute_ladder(layers: int) -> list[RecomputeConfig]:
    """A stage's recomputation options, keeping ever less: none, selective core_attn,
    selective core_attn + mlp, then full recomputation of its first 1, 2, ... layers."""
    return [
        RecomputeConfig(),
        RecomputeConfig("selective", modules=("core_attn",)),
        RecomputeConfig("selective", modules=("core_attn", "mlp")),
        *(RecomputeConfig("full", "block", n) for n in range(1, layers + 1)),
    ]


def recompute_to_balance(model: MemoryModel, counts: list[int]) -> tuple[RecomputeConfig, ...]:
    """Per-stage recomputation that evens out what layer counts alone cannot: while the
    deviation is at least BALANCED, move the stage whose next rung of `recompute_ladder`
    lowers the deviation most one rung up; stop when no move helps. () when none is needed."""
    flights = model.in_flight()
    ladders = [recompute_ladder(n) for n in counts]
    rungs = [0] * len(counts)

    def deviation_at(trial: list[int]) -> float:
        return deviation([model.stage(i, [n], flights[i], ladders[i][trial[i]])
                          for i, n in enumerate(counts)])  # fmt: skip

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
