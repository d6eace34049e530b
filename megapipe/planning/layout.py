"""One candidate layout, and the megapipe configs (ParallelConfig, OptimizerConfig,
RecomputeConfig) it stands for, so the planner's estimates are the framework's own."""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import OptimizerConfig, ParallelConfig, RecomputeConfig

# The recomputation choices the planner weighs (Megatron's): none, selective (the attention
# core), full (every layer, one layer per group).
RECOMPUTE_MODES: dict[str, RecomputeConfig] = {
    "none": RecomputeConfig(),
    "selective": RecomputeConfig("selective", modules=("core_attn",)),
    "full": RecomputeConfig("full", "uniform", 1),
}


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP ranks, VP model chunks per pipeline rank, the micro-batch, recomputation
    (a RECOMPUTE_MODES key), the distributed optimizer (ZeRO-1) and the pipeline schedule."""

    tp: int
    pp: int
    dp: int
    vp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    distributed_optimizer: bool = False
    schedule: str = "1f1b"

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.dp)

    def parallel_config(self, sequence_parallel: bool = False) -> ParallelConfig:
        return ParallelConfig(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp,
            pipeline_schedule=self.schedule,
            sequence_parallel=sequence_parallel and self.tp > 1,
        )

    def optimizer_config(self, half_precision: bool) -> OptimizerConfig:
        return OptimizerConfig(
            bf16=half_precision, use_distributed_optimizer=self.distributed_optimizer
        )

    @property
    def recompute_config(self) -> RecomputeConfig:
        return RECOMPUTE_MODES[self.recompute]

    def describe(self) -> str:
        """`TP8 PP4 VP2 DP32 mb1 full dist-opt interleaved-1f1b`."""
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vp > 1:
            parts.append(f"VP{self.vp}")
        parts += [f"DP{self.dp}", f"mb{self.micro_batch}", self.recompute]
        if self.distributed_optimizer:
            parts.append("dist-opt")
        parts.append(self.schedule)
        return " ".join(parts)
