"""Parameters per rank of a pipeline stage, and the bytes each one costs by data-parallel
sharding strategy (stage_memory.py's table), with mixtures of experts and expert parallelism.

An MoE layer holds its router (replicated over TP), its experts and the optional shared expert
(both split over TP like the dense MLP). Under expert parallelism (EP ranks, taken from the
DP x CP ranks) each rank holds E / EP experts; the router and the shared expert are dense
parameters, held by every EP rank. Dense parameters reduce gradients (and shard optimizer state
and, under ZeRO-2/3, parameters) over DP x CP ranks; expert parameters over the
expert-data-parallel ranks, DP x CP / EP (`MemoryModel.expert_shard_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.config import ModelConfig, OptimizerConfig


def layer_parameters(config: ModelConfig, tp: int, layer: int = 0, ep: int = 1) -> int:
    """Parameters of transformer layer `layer` (global index) on one TP rank: an MoE layer
    holds its router, E / ep experts and the shared expert."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d
    weights = (h * qkv + config.num_attention_heads * d * h) // tp
    biases = qkv // tp + h if config.add_bias_linear else 0
    norms = 2 * h * (2 if config.normalization == "LayerNorm" else 1)
    if config.qk_layernorm:  # q and k norms over the head dim, replicated across TP
        norms += 2 * d * (2 if config.normalization == "LayerNorm" else 1)
    if config.is_moe_layer(layer):
        moe = config.moe
        mlp = layer_expert_parameters(config, tp, layer, ep)
        mlp += moe.num_experts * h  # the router, replicated over TP
        if moe.moe_shared_expert_intermediate_size is not None:
            mlp += _mlp_parameters(config, moe.moe_shared_expert_intermediate_size, tp)
    else:
        mlp = _mlp_parameters(config, config.ffn_hidden_size, tp)
    return weights + biases + norms + mlp


def layer_expert_parameters(config: ModelConfig, tp: int, layer: int = 0, ep: int = 1) -> int:
    """The expert part of `layer_parameters` (0 on a dense layer): E / ep experts' MLPs."""
    if not config.is_moe_layer(layer):
        return 0
    experts = config.moe.num_experts // ep
    return experts * _mlp_parameters(config, config.moe_ffn_hidden_size, tp)


def _mlp_parameters(config: ModelConfig, ffn: int, tp: int) -> int:
    """One MLP of ffn size `ffn` on one TP rank (fc1 and its bias split, fc2's bias whole)."""
    h = config.hidden_size
    fc1 = ffn * (2 if config.swiglu else 1)
    biases = fc1 // tp + h if config.add_bias_linear else 0
    return (h * fc1 + ffn * h) // tp + biases


def _indices(layers: int | Sequence[int]) -> Sequence[int]:
    """A count n stands for layers 0..n-1; a range (or list) for those global indices."""
    return range(layers) if isinstance(layers, int) else layers


def stage_parameters(
    config: ModelConfig,
    layers: int | Sequence[int],
    first: bool,
    last: bool,
    tp: int,
    ep: int = 1,
) -> int:
    """Parameters one TP rank of a stage holds: its layers (a range of global indices, or a
    count, read as layers 0..count-1), and the embedding / output layer (with tied embeddings
    a last stage that is not also the first holds a copy); E / ep experts per MoE layer."""
    h, vocab = config.hidden_size, config.padded_vocab_size(tp)
    count = sum(layer_parameters(config, tp, i, ep) for i in _indices(layers))
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


def stage_expert_parameters(
    config: ModelConfig, layers: int | Sequence[int], tp: int, ep: int = 1
) -> int:
    """The expert parameters among `stage_parameters` (sharded over expert-DP ranks)."""
    if config.moe is None:
        return 0
    return sum(layer_expert_parameters(config, tp, i, ep) for i in _indices(layers))


def active_parameters(config: ModelConfig) -> int:
    """The whole model's parameters a token goes through (TP 1): every dense parameter, the
    router and the shared expert, and top-k of the E experts (what FLOPs count)."""
    total = stage_parameters(config, config.num_layers, True, True, 1)
    if config.moe is None:
        return total
    experts = stage_expert_parameters(config, config.num_layers, 1)
    return total - experts + experts * config.moe.moe_router_topk // config.moe.num_experts


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
    steps, gradients still held), by `optimizer.sharding` (stage_memory's table) over a shard
    group of `dp` ranks (DP x CP; DP x CP / EP for expert parameters). The optimizer state
    includes the fp32 master copy where there is a separate one."""
    d = sharded_over(optimizer, dp)
    param = training_dtype_bytes(optimizer)
    states = 2 if optimizer.optimizer == "adam" else (1 if optimizer.sgd_momentum else 0)
    if fsdp_shards(optimizer, dp):  # fp32 shards are the masters; fp32 sharded gradients
        return 4 / d, 4 / d, 4 * states / d
    state = 4 * states + (4 if param == 2 else 0)
    return param, 4, state / (d if optimizer.sharding == "optim" else 1)
