"""Bytes per GPU of a layout: pipeline/stage_memory.MemoryModel's numbers, nothing new.

MemoryModel gives each pipeline stage's parameters, gradients, optimizer state (each sharded
over DP as the layout's sharding strategy shards it), ZeRO-2/3's gathered parameters and peak
activations (model/activation_memory's per-layer formula times the micro-batches in flight).
With a mixture of experts each rank holds E / EP experts per MoE layer, their gradients and
optimizer state sharded over the expert-DP ranks (DP x CP / EP), and the MoE layers'
activations are the experts' rows under the layout's dispatcher (balanced routing).
The planner asks it for two stages only: with a uniform partition the middle stages hold the
same layers as the first with fewer micro-batches in flight and no embedding, so the largest
stage is the first or the last (the tests check this against every stage). In-flight counts
come from schedule_model (closed forms, or the simulator), which is what MemoryModel would
simulate itself, only faster for long pipelines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megapipe.config import ModelConfig
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.stage_memory import MemoryModel, StageMemory
from megapipe.planning.layout import Layout
from megapipe.planning.schedule_model import in_flight


@dataclass(frozen=True)
class LayoutMemory:
    """The largest stage's bytes per GPU, by kind."""

    stage: int
    parameters: int  # on one GPU of that stage
    params: float
    grads: float
    optimizer: float
    activations: float
    in_flight: int
    gathered: float = 0.0  # ZeRO-2/3: parameters FSDP2 holds gathered while the step runs
    expert_parameters: int = 0  # of `parameters`: E / EP experts per MoE layer

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    @classmethod
    def of(cls, stage: StageMemory) -> LayoutMemory:
        return cls(stage.stage, stage.parameters, stage.parameter_bytes, stage.gradient_bytes,
                   stage.optimizer_bytes, stage.activation_bytes, stage.in_flight,
                   stage.gathered_bytes, stage.expert_parameters)  # fmt: skip


def memory_model(
    model: ModelConfig,
    layout: Layout,
    global_batch: int,
    *,
    half_precision: bool = True,
    sequence_parallel: bool = False,
) -> MemoryModel:
    """The MemoryModel of `layout`, exactly as a run with those flags would build it on GPUs
    (attention dropout fused in the kernel: --attention-dropout-rng's CUDA default; the
    layout's MoE dispatcher)."""
    return MemoryModel(
        with_dispatcher(model, layout),
        layout.parallel_config(sequence_parallel),
        layout.optimizer_config(half_precision),
        layout.recompute_config,
        layout.micro_batch,
        layout.num_microbatches(global_batch),
        layout.dp,
        attention_dropout_fused=True,
    )


def with_dispatcher(model: ModelConfig, layout: Layout) -> ModelConfig:
    """`model` with the layout's --moe-token-dispatcher-type (unchanged for a dense model)."""
    if model.moe is None or model.moe.moe_token_dispatcher_type == layout.moe_dispatcher:
        return model
    moe = dataclasses.replace(model.moe, moe_token_dispatcher_type=layout.moe_dispatcher)
    return dataclasses.replace(model, moe=moe)


def candidate_stages(layout: Layout) -> list[int]:
    """The stages that can be the largest under a uniform partition: the first and the last."""
    return sorted({0, layout.pp - 1})


def stage_memories(
    model: ModelConfig,
    layout: Layout,
    global_batch: int,
    *,
    half_precision: bool = True,
    sequence_parallel: bool = False,
    stages: list[int] | None = None,
) -> list[StageMemory]:
    """MemoryModel.stage for the given pipeline ranks (default: the candidates for the peak)."""
    estimate = memory_model(model, layout, global_batch, half_precision=half_precision,
                            sequence_parallel=sequence_parallel)  # fmt: skip
    stage_map = partition_layers(model, layout.pp, layout.vp)
    flights = in_flight(layout.schedule, layout.pp, layout.vp, estimate.num_microbatches)
    ranks = candidate_stages(layout) if stages is None else stages
    return [estimate.stage(r, list(stage_map.layers[r]), flights[r]) for r in ranks]


def layout_memory(
    model: ModelConfig,
    layout: Layout,
    global_batch: int,
    *,
    half_precision: bool = True,
    sequence_parallel: bool = False,
) -> LayoutMemory:
    """The peak bytes per GPU of `layout`: its largest pipeline stage."""
    stages = stage_memories(model, layout, global_batch, half_precision=half_precision,
                            sequence_parallel=sequence_parallel)  # fmt: skip
    return LayoutMemory.of(max(stages, key=lambda s: s.total_bytes))
