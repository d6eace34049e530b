"""Memory per pipeline stage (megapipe/pipeline/stage_memory.py) and --pipeline-partition
memory: the parameter counts are the built models' own, the activation estimate matches the
peak of saved tensors measured over a real PP2 iteration, the memory partition evens GPT-3
1.3B's stages out as well as any contiguous split can, and it trains to uniform's losses."""

from __future__ import annotations

import itertools
import re

import pytest

from megapipe.config import (
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
)
from megapipe.conversion.convert import build_rank
from megapipe.errors import ConfigError
from megapipe.pipeline.partition import partition_layers, uniform_counts
from megapipe.pipeline.stage_memory import (
    MemoryModel,
    StageMemory,
    deviation,
    plan_stages,
    stage_parameters,
)
from megapipe.testing import run_distributed, train_with_flags

GPT3_1_3B = ModelConfig(
    num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257, seq_length=2048,
    max_position_embeddings=2048, attention_dropout=0.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "shape",
    [{}, {"untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
          "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
          "num_query_groups": 2},
     {"moe": MoEConfig(num_experts=4, moe_layer_freq=(1, 0, 1, 1, 0, 1), moe_ffn_hidden_size=24,
                       moe_shared_expert_intermediate_size=16), "swiglu": True}],
    ids=["gpt", "llama", "moe"],
)  # fmt: skip
def test_parameter_counts_are_the_built_models(shape: dict) -> None:
    config = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4, vocab_size=100,
                         seq_length=16, max_position_embeddings=16, **shape)  # fmt: skip
    for tp, ranges in ((2, [range(0, 2), range(2, 5), range(5, 6)]), (1, [range(0, 6)])):
        pp = len(ranges)
        for stage, layers in enumerate(ranges):
            (model,) = build_rank(config, 0, tp, stage, [layers], pp)
            built = sum(p.numel() for p in model.parameters())
            assert stage_parameters(config, layers, stage == 0, stage == pp - 1, tp) == built


ARGV = [
    "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
    "64", "--mock-data", "--vocab-size", "100", "--micro-batch-size", "4",
    "--global-batch-size", "16", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
    "--pipeline-model-parallel-size", "2", "--log-interval", "1",
]  # fmt: skip
MEASURED = re.compile(r"peak saved activations (\S+) MiB \(estimate (\S+) MiB\)")


def _run(rank: int, world: int, argv: list[str]) -> tuple[list[float], str]:
    results, out = train_with_flags(rank, world, argv)
    return [r.lm_loss for r in results], out


def test_estimate_matches_the_measured_peak_and_memory_partition_trains_alike() -> None:
    uniform = run_distributed(_run, 2, ARGV)
    memory = run_distributed(_run, 2, ARGV + ["--pipeline-partition", "memory"])
    for rank in range(2):
        measured, estimate = map(float, MEASURED.search(uniform[rank][1]).groups())
        print(f"\nstage {rank}: measured {measured} MiB, estimated {estimate} MiB")
        assert abs(measured - estimate) <= 0.05 * measured
    table = memory[0][1]
    assert "memory per pipeline stage" in table and "largest deviation" in table
    layer_map = re.findall(r"\((\d), 0\): \S+ \((\d) layers\)", table)
    assert [int(n) for _, n in layer_map] != [3, 3]  # stage 0 holds 2 micro-batches: fewer layers
    for ours, theirs in zip(memory[0][0], uniform[0][0]):  # same model, other split
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)


def _best_possible(model: MemoryModel, p: int) -> float:
    """The smallest deviation of any contiguous split (brute force)."""
    cost = model.stage_bytes()
    table = [[cost(s, n) if n else 0.0 for n in range(25)] for s in range(p)]
    best = float("inf")
    for cuts in itertools.combinations(range(1, 24), p - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, 24))]
        totals = [table[s][n] for s, n in enumerate(counts)]
        mean = sum(totals) / p
        best = min(best, max(abs(t - mean) for t in totals) / mean)
    return best


@pytest.mark.parametrize("p", [4, 8])
def test_memory_partition_evens_out_gpt3_1_3b(p: int) -> None:
    model = MemoryModel(GPT3_1_3B, ParallelConfig(pipeline_model_parallel_size=p),
                        OptimizerConfig(bf16=True), RecomputeConfig(), 1, 32, 1)  # fmt: skip
    before = deviation(model.stages(partition_layers(GPT3_1_3B, p)))
    chosen = partition_layers(GPT3_1_3B, p, method="memory", stage_bytes=model.stage_bytes())
    after = deviation(model.stages(chosen))
    print(f"\nGPT-3 1.3B PP={p}: deviation from the mean {before:.1%} uniform, {after:.1%} memory")
    assert after < before
    assert after <= _best_possible(model, p) + 1e-9
    if p == 4:
        assert after < 0.15
    assert uniform_counts(24, p, 1) != [len(c[0]) for c in chosen.layers]
    # where layer counts cannot get under 15%, per-stage recomputation does
    parallel = ParallelConfig(pipeline_model_parallel_size=p, pipeline_partition="memory")
    planned = plan_stages(GPT3_1_3B, parallel, micro_batch_size=1, num_microbatches=32,
                          optimizer=OptimizerConfig(bf16=True), recompute=RecomputeConfig(),
                          data_parallel_size=1)  # fmt: skip
    with_recompute = deviation(model.stages(planned))
    print(f"  with per-stage recomputation: {with_recompute:.1%} "
          f"({', '.join(r.describe() for r in planned.recompute) or 'none needed'})")  # fmt: skip
    assert with_recompute < 0.15
    assert bool(planned.recompute) == (p == 8)


def test_per_stage_recomputation_trains_to_the_same_losses() -> None:
    """Four 1-layer stages cannot be evened by layer counts: the memory partition recomputes
    inside the first stages, which changes memory and not one bit of the losses."""
    argv = ARGV + ["--num-layers", "4", "--pipeline-model-parallel-size", "4",
                   "--global-batch-size", "32"]  # fmt: skip
    uniform = run_distributed(_run, 4, argv)
    memory = run_distributed(_run, 4, argv + ["--pipeline-partition", "memory"])
    assert "recomputing selective" in memory[0][1]
    assert memory[0][0] == uniform[0][0]


def test_memory_partition_refuses_virtual_stages() -> None:
    from megapipe.arguments import parse_args

    with pytest.raises(ConfigError, match="--pipeline-partition memory chooses every stage"):
        parse_args(ARGV + ["--pipeline-partition", "memory",
                           "--num-layers-per-virtual-pipeline-stage", "1"], 2)  # fmt: skip


def test_the_estimate_counts_attention_dropout_where_it_runs():
    # CUDA's default runs attention dropout inside the fused kernel (no s x s activations);
    # the CPU's, and --attention-dropout-rng layout-invariant anywhere, the unfused attention
    from megapipe.arguments import parse_args

    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size",
             "1", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
             "--mock-data", "--vocab-size", "128", "--attention-dropout", "0.1",
             "--pipeline-model-parallel-size", "2"]  # fmt: skip
    configs = parse_args(flags, 2)
    stage_map = partition_layers(configs.model, 2, 1)
    cuda = MemoryModel.of(configs, "cuda")
    cpu = MemoryModel.of(configs, "cpu")
    invariant = MemoryModel.of(parse_args(flags + ["--attention-dropout-rng", "layout-invariant"],
                                          2), "cuda")  # fmt: skip
    assert cuda.attention_dropout_fused and not cpu.attention_dropout_fused
    assert not invariant.attention_dropout_fused
    for fused, unfused in zip(cuda.stages(stage_map), cpu.stages(stage_map)):
        assert fused.activation_bytes < unfused.activation_bytes
        assert fused.parameter_bytes == unfused.parameter_bytes


# --------------------------------------------------------------------------------------------
# Sharded data parallelism: bytes per parameter by strategy, and FSDP2's gathered parameters.
# --------------------------------------------------------------------------------------------

STRATEGIES = {  # OptimizerConfig fields -> the strategy Megatron-LM names
    "no_shard": {},
    "optim": {"use_distributed_optimizer": True},
    "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
    "optim_grads_params": {"data_parallel_sharding_strategy": "optim_grads_params"},
}


def _formula(strategy: str, bf16: bool, d: int) -> float:
    """Adam's bytes per parameter at rest over a shard group of d (stage_memory's table)."""
    if strategy in ("optim_grads", "optim_grads_params") and d > 1:
        return 16 / d  # fp32 shard (the master) + fp32 grad + m, v: all sharded
    if strategy == "optim":
        return 6 + 12 / d if bf16 else 8 + 8 / d
    return 18 if bf16 else 16


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_bytes_per_parameter_follow_each_strategys_formula(strategy: str) -> None:
    from megapipe.pipeline.stage_memory import bytes_per_parameter

    for bf16, dp in itertools.product((False, True), (1, 2, 4, 8)):
        config = OptimizerConfig(bf16=bf16, **STRATEGIES[strategy])
        assert sum(bytes_per_parameter(config, dp)) == pytest.approx(_formula(strategy, bf16, dp))
        if strategy in ("optim_grads", "optim_grads_params") and dp >= 4:  # hybrid: d = dp / N
            hybrid = OptimizerConfig(bf16=bf16, num_distributed_optimizer_instances=2,
                                     **STRATEGIES[strategy])  # fmt: skip
            assert sum(bytes_per_parameter(hybrid, dp)) == pytest.approx(16 / (dp // 2))


def test_gathered_parameters_are_every_layer_under_zero2_and_one_under_zero3() -> None:
    """In layer units (the tiny model's layers outweigh its embedding): ZeRO-2 holds the root
    group and all L layers plus one layer's all-gather buffer, ZeRO-3 the root and one layer
    plus a buffer (two with forward prefetching); nothing without FSDP2 or with one rank."""
    from megapipe.pipeline.stage_memory import gathered_parameter_bytes, layer_parameters

    config = ModelConfig(num_layers=6, hidden_size=32, num_attention_heads=4, vocab_size=100,
                         seq_length=16, max_position_embeddings=16)  # fmt: skip
    layer, root = layer_parameters(config, 1), stage_parameters(config, 0, True, True, 1)
    assert layer > root

    def gathered(strategy: str, dp: int = 2, layers: int = 6, **fields) -> int:
        optimizer = OptimizerConfig(**STRATEGIES[strategy], **fields)
        return gathered_parameter_bytes(config, optimizer, dp, layers, True, True, 1)

    assert gathered("optim_grads") == (root + 7 * layer) * 4
    assert gathered("optim_grads", bf16=True) == (root + 7 * layer) * 2
    assert gathered("optim_grads_params") == (root + 2 * layer) * 4
    assert gathered("optim_grads_params", overlap_param_gather=True) == (root + 3 * layer) * 4
    assert gathered("optim_grads_params", layers=1, overlap_param_gather=True) == (
        root + 2 * layer) * 4  # fmt: skip
    assert gathered("no_shard") == gathered("optim") == 0
    assert gathered("optim_grads_params", dp=1) == 0  # the plain path
    assert gathered("optim_grads_params", dp=2, num_distributed_optimizer_instances=2) == 0


TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
    "16", "--max-position-embeddings", "16", "--mock-data", "--micro-batch-size", "1",
    "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
]  # fmt: skip
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
ZERO3 = ["--use-torch-fsdp2"]


def _measure(rank: int, world: int, argv: list[str]) -> tuple[dict, StageMemory]:
    import contextlib
    import io

    from megapipe.arguments import parse_args
    from megapipe.parallel.state import ParallelState
    from megapipe.testing.step_memory import measure_step
    from megapipe.training.build import stage_map_for
    from megapipe.training.step_by_step import Stepper

    configs = parse_args(argv, world)
    parallel = configs.parallel
    state = ParallelState.build(
        parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
        data_parallel_instances=configs.optimizer.num_distributed_optimizer_instances,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        stepper = Stepper.build(configs, state)
    measured = measure_step(stepper)
    estimate = MemoryModel.of(configs).stages(stage_map_for(configs))[state.pp.rank]
    return measured, estimate


@pytest.mark.parametrize(
    "world, flags",
    [
        (2, ZERO3 + ["--vocab-size", "1000"]),  # the embedding outweighs a layer
        (2, ZERO3 + ["--bf16", "--overlap-param-gather", "--vocab-size", "100"]),
        (2, ZERO2 + ["--vocab-size", "100"]),
        (4, ZERO2 + ["--bf16", "--num-distributed-optimizer-instances", "2", "--vocab-size",
                     "1000"]),
        (4, ZERO3 + ["--pipeline-model-parallel-size", "2", "--vocab-size", "100"]),
    ],
    ids=["zero3-fp32", "zero3-bf16-prefetch", "zero2-fp32", "zero2-bf16-hybrid", "zero3-pp2"],
)  # fmt: skip
def test_sharded_estimate_matches_a_measured_step(world: int, flags: list[str]) -> None:
    """One training step per rank: the optimizer's bytes by kind, read after backward and the
    step (before zero_grad), and the peak of FSDP2's gathered parameters and all-gather
    buffers (megapipe/testing/step_memory.py), against the stage's estimate."""
    argv = TINY + ["--global-batch-size", str(2 * world)] + flags
    for measured, estimate in run_distributed(_measure, world, argv):
        n = measured["num_params"]
        assert n == estimate.parameters
        kinds = measured["bytes_per_param"]
        at_rest = estimate.parameter_bytes + estimate.gradient_bytes + estimate.optimizer_bytes
        print(f"\n{' '.join(flags)}: stage {estimate.stage} measured "
              f"{sum(kinds.values()):.3f} B/param at rest, estimated {at_rest / n:.3f}; gathered "
              f"{measured['gathered_bytes']} B {measured['gathered_parts']}, estimated "
              f"{estimate.gathered_bytes:.0f} B")  # fmt: skip
        assert kinds["params"] * n == pytest.approx(estimate.parameter_bytes, rel=0.01)
        assert kinds["grads"] * n == pytest.approx(estimate.gradient_bytes, rel=0.01)
        assert (kinds["master"] + kinds["optimizer"]) * n == pytest.approx(
            estimate.optimizer_bytes, rel=0.01)  # fmt: skip
        assert measured["gathered_bytes"] == pytest.approx(estimate.gathered_bytes, rel=0.01)
        assert estimate.gathered_bytes > 0
        if estimate.stage == 0 and world == 4 and "--num-distributed-optimizer-instances" in flags:
            assert at_rest / n == pytest.approx(16 / 2, rel=0.01)  # shard group of 2, not 4


def test_the_start_up_table_shows_the_gathered_parameters() -> None:
    from megapipe.pipeline.stage_memory import describe

    model = MemoryModel(GPT3_1_3B, ParallelConfig(pipeline_model_parallel_size=4),
                        OptimizerConfig(bf16=True, data_parallel_sharding_strategy="optim_grads"),
                        RecomputeConfig(), 1, 32, 8)  # fmt: skip
    stages = model.stages(partition_layers(GPT3_1_3B, 4))
    table = describe(stages)
    assert "gathered params" in table
    for s in stages:  # ZeRO-2: every layer of the stage (GPT-3 1.3B's are 50M parameters each)
        assert s.gathered_bytes >= s.layers * 50_000_000 * 2
        assert s.total_bytes > s.parameter_bytes + s.gradient_bytes + s.optimizer_bytes + (
            s.activation_bytes)  # fmt: skip
    assert "gathered params" not in describe(
        MemoryModel(GPT3_1_3B, ParallelConfig(pipeline_model_parallel_size=4),
                    OptimizerConfig(bf16=True), RecomputeConfig(), 1, 32, 8).stages(
            partition_layers(GPT3_1_3B, 4)))  # fmt: skip


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_estimate_under_context_parallelism_matches_the_measured_peak(comm_type: str) -> None:
    """CP2 x PP2 with rope: each stage's peak of saved tensors over a real iteration is the
    estimate at S / CP plus what the comm type keeps (within 5%); the estimate at one CP rank's
    full sequence would be about twice the measured peak, so this check can tell them apart."""
    argv = ARGV + ["--context-parallel-size", "2", "--cp-comm-type", comm_type,
                   "--position-embedding-type", "rope", "--attention-dropout", "0",
                   "--emulate-nccl-p2p-order"]  # fmt: skip
    runs = run_distributed(_run, 4, argv)
    for rank in (0, 2):  # the first rank of each pipeline stage prints its line
        measured, estimate = map(float, MEASURED.search(runs[rank][1]).groups())
        print(f"\n{comm_type} stage {rank // 2}: measured {measured} MiB, estimated {estimate} MiB")
        assert abs(measured - estimate) <= 0.05 * measured
