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

# The data-parallel sharding strategies (OptimizerConfig.data_parallel_sharding_strategy, in
# Megatron-LM's words) and how describe() names them: "" plain DP, "dist-opt" the distributed
# optimizer (ZeRO-1), "ZeRO-2" / "ZeRO-3" sharded gradients (and parameters) on FSDP2.
SHARDING: dict[str, str] = {
    "no_shard": "",
    "optim": "dist-opt",
    "optim_grads": "ZeRO-2",
    "optim_grads_params": "ZeRO-3",
}
FSDP_SHARDING = ("optim_grads", "optim_grads_params")  # gradients sharded: run on FSDP2


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP ranks, VP model chunks per pipeline rank, the micro-batch, recomputation
    (a RECOMPUTE_MODES key), the data-parallel sharding (a SHARDING key: no_shard, optim =
    the distributed optimizer, optim_grads = ZeRO-2, optim_grads_params = ZeRO-3), the
    pipeline schedule, and context parallelism: CP ranks per sequence (in Megatron's rank
    order tp-cp-dp-pp, so the world is TP x CP x DP x PP) and how they exchange keys and
    values (--cp-comm-type); and expert parallelism (MoE models): EP ranks of each DP x CP
    group split every MoE layer's experts (not a factor of the world: the expert layout
    tp-ep-dp-pp takes them from DP x CP) and exchange tokens by `moe_dispatcher` (alltoall or
    allgather, --moe-token-dispatcher-type)."""

    tp: int
    pp: int
    dp: int
    vp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    sharding: str = "no_shard"
    schedule: str = "1f1b"
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    moe_dispatcher: str = "alltoall"

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING:  # also catches the old bool distributed_optimizer
            raise ValueError(f"Layout.sharding {self.sharding!r} is not one of "
                             f"{', '.join(SHARDING)}")  # fmt: skip

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1: megapipe's distributed optimizer (--use-distributed-optimizer)."""
        return self.sharding == "optim"

    @property
    def fsdp(self) -> bool:
        """Gradients (ZeRO-2) and parameters (ZeRO-3) sharded too: torch's FSDP2."""
        return self.sharding in FSDP_SHARDING

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts, over which expert gradients reduce: DP x CP / EP."""
        return self.dp * self.cp // self.ep

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.dp)

    def parallel_config(self, sequence_parallel: bool = False) -> ParallelConfig:
        return ParallelConfig(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp,
            pipeline_schedule=self.schedule,
            sequence_parallel=sequence_parallel and self.tp > 1,
            context_parallel_size=self.cp,
            cp_comm_type=self.cp_comm_type,
            expert_model_parallel_size=self.ep,
        )

    def optimizer_config(self, half_precision: bool) -> OptimizerConfig:
        """As arguments/sharding_flags.resolve_sharding settles the flags: the distributed
        optimizer's flag for optim, the strategy itself for ZeRO-2/3."""
        return OptimizerConfig(
            bf16=half_precision,
            use_distributed_optimizer=self.distributed_optimizer,
            data_parallel_sharding_strategy=self.sharding if self.fsdp else "no_shard",
        )

    @property
    def recompute_config(self) -> RecomputeConfig:
        return RECOMPUTE_MODES[self.recompute]

    def describe(self) -> str:
        """`TP8 PP4 VP2 DP32 mb1 full dist-opt interleaved-1f1b`, `TP1 PP1 DP64 mb1 none
        ZeRO-3 1f1b`, `TP8 CP4 (a2a) PP1 DP2 mb1 none 1f1b`, `TP2 PP1 DP8 EP8 mb1 none
        dist-opt 1f1b` (EP1 unnamed; a dispatcher other than alltoall in brackets)."""
        parts = [f"TP{self.tp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}" + ("" if self.cp_comm_type == "p2p" else
                                            f" ({self.cp_comm_type})"))  # fmt: skip
        parts.append(f"PP{self.pp}")
        if self.vp > 1:
            parts.append(f"VP{self.vp}")
        parts.append(f"DP{self.dp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}" + ("" if self.moe_dispatcher == "alltoall" else
                                            f" ({self.moe_dispatcher})"))  # fmt: skip
        parts += [f"mb{self.micro_batch}", self.recompute]
        if SHARDING[self.sharding]:
            parts.append(SHARDING[self.sharding])
        parts.append(self.schedule)
        return " ".join(parts)
