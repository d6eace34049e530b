"""Build the model chunks one pipeline rank owns, from the stage map."""

from __future__ import annotations

from megapipe.config import KernelConfig, ModelConfig, RecomputeConfig
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.partition import StageMap


def build_model_chunks(
    config: ModelConfig,
    state: ParallelState,
    rng: RNGTracker,
    stage_map: StageMap,
    *,
    seed: int,
    sequence_parallel: bool = False,
    recompute: RecomputeConfig | None = None,
    kernels: KernelConfig | None = None,
) -> list[GPTModel]:
    """Chunk c of this rank holds the layers of virtual stage c * p + pp_rank."""
    if stage_map.pipeline_size != state.pp.size:
        raise ValueError(
            f"stage map is for {stage_map.pipeline_size} pipeline ranks, the "
            f"pipeline group has {state.pp.size}"
        )
    return [
        GPTModel(
            config,
            state,
            rng,
            seed=seed,
            sequence_parallel=sequence_parallel,
            layers=layers,
            recompute=recompute,
            kernels=kernels,
        )
        for layers in stage_map.layers[state.pp.rank]
    ]


def activation_shape(
    config: ModelConfig, micro_batch_size: int, tp_size: int, sequence_parallel: bool
) -> tuple[int, int, int]:
    """[sequence, batch, hidden] of the tensors sent between stages (sequence-sharded by SP)."""
    seq = config.seq_length // tp_size if sequence_parallel and tp_size > 1 else config.seq_length
    return (seq, micro_batch_size, config.hidden_size)
