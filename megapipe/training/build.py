"""Building a run, once: one rank's model chunks, pipeline executor, optimizer, data and evaluators.

`build_run` returns them together as a `Run`; the training loop (`train.py`) and the
hand-stepped run of benchmarks and tests (`step_by_step.py`) both start from it. The layer split
over pipeline stages is the one validation planned (`Configs.stage_map`), and the fault plan of
MEGAPIPE_FAULT (training/faults.py) is read here, once, into the run's `Activity`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.activity import Activity
from megapipe.config import Configs
from megapipe.console import print_line
from megapipe.data.sources import BatchSources, build_batch_sources
from megapipe.distributed.fsdp import describe_sharding, shard_chunks, uses_fsdp
from megapipe.distributed.fsdp_optimizer import FSDPOptimizer
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.loss_scaler import make_loss_scaler
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.layers.linear import set_tp_comm_overlap
from megapipe.layers.param_meta import is_expert
from megapipe.model.attention_backends import check_attention_backend, describe_attention
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import StageMap
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.stage_memory import MemoryModel, StageMemory, plan_stages
from megapipe.pipeline.stage_memory import describe as describe_stage_memory
from megapipe.training.batch_size import BatchSizeSchedule, batch_size_schedule_of
from megapipe.training.evaluation import Evaluator
from megapipe.training.faults import FaultPlan
from megapipe.training.log_format import parameter_count_line, world_size_line
from megapipe.training.printing import print_rank_0


@dataclass(frozen=True)
class SampleCounts:
    """Samples each split is built for, as Megatron sizes them."""

    train: int
    valid: int
    test: int

    @classmethod
    def of(cls, configs: Configs, schedule: BatchSizeSchedule) -> SampleCounts:
        training = configs.training
        train = schedule.samples_for_iterations(training.train_iters)
        if training.eval_iters == 0:
            return cls(train, 0, 0)
        interval = training.eval_interval
        evaluations = training.train_iters // interval if interval else 0
        per_evaluation = training.eval_iters * training.global_batch_size
        return cls(train, (evaluations + 1) * per_evaluation, per_evaluation)


@dataclass
class Run:
    """One rank's share of a run, as built: everything the loop steps, evaluates and saves.

    `stage_memory` is the memory model's estimate per pipeline stage (None when PP=1);
    `activity` is what this rank is doing, for the watchdog, errors and the fault plan."""

    configs: Configs
    state: ParallelState
    activity: Activity
    stage_map: StageMap
    stage_memory: list[StageMemory] | None
    chunks: list[GPTModel]
    executor: PipelineExecutor
    optimizer: ShardedOptimizer
    batch_sizes: BatchSizeSchedule
    data: BatchSources
    evaluators: dict[str, Evaluator]


def build_run(
    configs: Configs,
    state: ParallelState,
    activity: Activity | None = None,
    *,
    samples: SampleCounts | None = None,
    announce: bool = True,
) -> Run:
    """Build this rank's run (collective: call on every rank alike).

    `activity` defaults to a new one holding MEGAPIPE_FAULT's plan for this rank. `samples`
    sizes the data splits (default: Megatron's sizes for --train-iters and the evaluations).
    `announce`: check the attention backend and print Megatron's start-up lines, as
    pretrain_gpt.py does (benchmarks and tests that step a run by hand build it quietly)."""
    activity = activity or Activity(state, FaultPlan.from_env(os.environ, state.rank))
    if announce:
        _check_and_announce_layout(configs, state)
    stage_map = stage_map_for(configs)
    memory = (
        MemoryModel.of(configs, state.device.type).stages(stage_map) if state.pp.size > 1 else None
    )
    if announce and memory is not None:
        print_rank_0(state, stage_map.describe())
        print_rank_0(state, describe_stage_memory(memory))
    chunks = build_model_chunks_for(configs, state, stage_map)
    if announce:
        _announce_model(configs, state, chunks)
    optimizer = build_optimizer(chunks, configs, state, activity)  # FSDP2 wraps chunks first
    executor = build_executor(chunks, configs, state, activity)
    batch_sizes = batch_size_schedule_of(configs.training, state.dp.size)
    counts = samples or SampleCounts.of(configs, batch_sizes)
    data = build_batch_sources(  # mock samples, or the splits of --data-path (rank 0 indexes)
        configs, train_samples=counts.train, valid_samples=counts.valid, test_samples=counts.test
    )
    evaluators = build_evaluators(
        chunks, executor, data, configs, state, after=optimizer.after_forward_only
    )
    return Run(configs, state, activity, stage_map, memory, chunks, executor, optimizer,
               batch_sizes, data, evaluators)  # fmt: skip


def _check_and_announce_layout(configs: Configs, state: ParallelState) -> None:
    """Megatron's world-size line; a forced attention backend that cannot run here fails now."""
    print_rank_0(
        state,
        world_size_line(
            state.world_size, state.dp.size, state.tp.size, state.pp.size, state.cp.size
        ),
    )
    sharding = describe_sharding(configs.optimizer, state)
    if sharding is not None:
        print_rank_0(state, sharding)
    if state.device.type == "cuda":  # not in the memory estimate (docs/gpu.md)
        kinds = state.communicators()
        print_rank_0(
            state,
            f"NCCL communicators on rank 0: {len(kinds)} ({', '.join(kinds)}); their buffers "
            "are not in the memory estimate",
        )
    check_attention_backend(
        configs.kernels.attention_backend,
        state.device,
        configs.optimizer.params_dtype,
        attention_dropout=configs.model.attention_dropout,
        reset_attention_mask=configs.data.reset_attention_mask,
        head_dim=configs.model.head_dim,
        dropout_rng=configs.kernels.attention_dropout_rng,
    )


def _announce_model(configs: Configs, state: ParallelState, chunks: list[GPTModel]) -> None:
    """The kernels and attention path chosen, and each model-parallel rank's parameter count."""
    print_rank_0(state, chunks[0].kernel_choices.describe())
    print_rank_0(state, describe_attention(
        configs.kernels.attention_backend, configs.kernels.attention_dropout_rng, state.device,
        configs.optimizer.params_dtype, attention_dropout=configs.model.attention_dropout,
        reset_attention_mask=configs.data.reset_attention_mask,
        softmax=chunks[0].kernel_choices.chosen["masked_softmax"]))  # fmt: skip
    # one line per model-parallel rank (CP ranks hold the same); with expert parallelism one
    # per EP rank too, which hold different experts
    if state.expert_dp.rank == 0:  # expert DP is DP x CP without expert parallelism
        params = [p for chunk in chunks for p in chunk.parameters()]
        count = sum(p.numel() for p in params)
        experts = None
        if state.ep.size > 1:
            local = configs.model.moe.num_experts // state.ep.size
            in_experts = sum(p.numel() for p in params if is_expert(p))
            experts = (state.ep.rank, state.ep.size, in_experts, local)
        print_line(parameter_count_line(state.tp_rank, state.pp_rank, count, experts))


def stage_map_for(configs: Configs) -> StageMap:
    """The run's layer split over pipeline stages (--pipeline-partition): the one validation
    planned, or (configs built without validation) planned now."""
    if configs.stage_map is not None:
        return configs.stage_map
    return plan_stages(
        configs.model,
        configs.parallel,
        micro_batch_size=configs.training.micro_batch_size,
        num_microbatches=configs.training.num_microbatches(configs.data_parallel_size),
        optimizer=configs.optimizer,
        recompute=configs.recompute,
        data_parallel_size=configs.data_parallel_size,
    )


def build_model_chunks_for(
    configs: Configs, state: ParallelState, stage_map: StageMap | None = None
) -> list[GPTModel]:
    """Seed this rank's random streams and build its model chunks in training mode."""
    seed = configs.training.seed
    tracker = RNGTracker(seed, state.tp_rank, state.pp_rank, state.device)
    tracker.seed_default()
    stage_map = stage_map or stage_map_for(configs)
    recompute = configs.recompute  # or what --pipeline-partition memory chose for this stage
    if stage_map.recompute:
        recompute = stage_map.recompute[state.pp_rank]
    chunks = build_model_chunks(
        configs.model,
        state,
        tracker,
        stage_map,
        seed=seed,
        sequence_parallel=configs.parallel.sequence_parallel,
        recompute=recompute,
        kernels=configs.kernels,
    )
    # FSDP2 keeps fp32 shards as the masters and gathers them in the training dtype
    dtype = torch.float32 if uses_fsdp(configs.optimizer, state) else configs.optimizer.params_dtype
    for chunk in chunks:
        chunk.to(dtype)
        chunk.train()
        set_tp_comm_overlap(chunk, configs.parallel.tp_comm_overlap)
    return chunks


def build_optimizer(
    chunks: list[GPTModel],
    configs: Configs,
    state: ParallelState,
    activity: Activity | None = None,
) -> ShardedOptimizer:
    """Gradient buffers for every chunk, and the (possibly sharded) mixed-precision optimizer;
    `activity` records what they wait in. With sharded gradients (ZeRO-2/3) the chunks are
    wrapped in FSDP2 here instead (in place), and the optimizer steps their shards."""
    opt = configs.optimizer
    scaler = make_loss_scaler(
        fp16=opt.fp16,
        loss_scale=opt.loss_scale if opt.fp16 else None,
        initial_loss_scale=opt.initial_loss_scale,
        min_loss_scale=opt.min_loss_scale,
        loss_scale_window=opt.loss_scale_window,
        hysteresis=opt.hysteresis,
    )
    decoupled = configs.training.decoupled_lr is not None  # the embedding's own LR groups
    if uses_fsdp(opt, state):
        layers = [list(chunk.decoder.layers.values()) for chunk in chunks]
        modules = shard_chunks(chunks, layers, state, opt)
        return FSDPOptimizer(
            chunks, modules, state, opt, configs.training.lr, scaler, decoupled=decoupled
        )
    num_microbatches = configs.training.num_microbatches(state.dp.size)  # samples: DP only
    # Gradients are averaged, and the distributed optimizer shards, over the ranks that hold
    # the same parameters: DP x CP (`dp_cp`, which is `dp` without context parallelism).
    group, replicas = state.dp_cp, None  # hybrid: shard inside the instance, all-reduce across
    shard = opt.use_distributed_optimizer
    if shard and state.dp_inner is not None:
        group, replicas = state.dp_inner, state.dp_outer
        if group.size == 1:  # instances of one rank: nothing to shard, plain all-reduce
            group, replicas, shard = state.dp_cp, None, False
    group_name = "data-parallel group"
    if state.cp.size > 1:
        group_name = "data-parallel x context-parallel group"
    expert_parallel = state.ep.size > 1
    buffers = [
        GradBuffer(
            [p for p in chunk.parameters() if not (expert_parallel and is_expert(p))],
            group,
            num_microbatches=num_microbatches,
            bucket_size=opt.ddp_bucket_size,
            overlap=opt.overlap_grad_reduce,
            shard=shard,
            solo=_solo_tied_embedding(chunk, state, shard),
            activity=activity,
            replicas=replicas,
            group_name=group_name,
        )
        for chunk in chunks
    ]
    if expert_parallel:  # experts: reduced (and sharded) over the ranks holding the same ones
        experts = [[p for p in chunk.parameters() if is_expert(p)] for chunk in chunks]
        buffers += [
            GradBuffer(
                params,
                state.expert_dp,
                num_microbatches=num_microbatches,
                bucket_size=opt.ddp_bucket_size,
                overlap=opt.overlap_grad_reduce,
                shard=shard,
                activity=activity,
                group_name="expert-data-parallel group",
                average_over=state.dp_cp.size,
            )
            for params in experts
            if params
        ]
    optimizer = ShardedOptimizer(
        buffers, state, opt, configs.training.lr, scaler, decoupled=decoupled
    )
    if replicas is not None:
        optimizer.norm_replicas = replicas.size
    return optimizer


def _solo_tied_embedding(chunk: GPTModel, state: ParallelState, sharded: bool) -> list:
    """The tied word embedding as a GradBuffer's solo parameter (a bucket of its own) when
    the distributed optimizer shards the buckets and the embedding's copies on the first and
    last pipeline stages are summed over the embedding group after the reduce-scatter: both
    copies must then be sharded alike (Megatron-Core's rule too). Otherwise it shares the
    buckets: every rank holds its whole gradient, and at DP=2 one bucket instead of two is one
    synchronous gloo collective less (a DP=2 step's gradient sync went from 7.0 to 5.0 ms)."""
    if state.pp.size == 1 or not sharded:
        return []
    return [p for p in [chunk.shared_word_embedding()] if p is not None]


def build_executor(
    chunks: list[GPTModel],
    configs: Configs,
    state: ParallelState,
    activity: Activity | None = None,
) -> PipelineExecutor:
    """The pipeline executor running this rank's schedule (plain accumulation when PP=1)."""
    parallel, training = configs.parallel, configs.training
    num_microbatches = training.num_microbatches(state.dp.size)
    actions = build_schedule(
        parallel.schedule,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        num_microbatches,
        state.pp_rank,
        post_ahead=parallel.pipeline_receives_ahead,
    )
    shape = activation_shape(
        configs.model, training.micro_batch_size, state.tp.size, parallel.sequence_parallel
    )
    return PipelineExecutor(
        chunks,
        state,
        actions,
        num_microbatches=num_microbatches,
        activation_shape=shape,
        dtype=configs.optimizer.params_dtype,
        comm=P2PCommunicator(
            state,
            parallel.pipeline_p2p_timeout,
            activity,
            emulate_nccl_order=parallel.emulate_nccl_p2p_order,
        ),
        batch_on_every_stage=configs.data.reset_attention_mask,
        post_ahead=parallel.pipeline_receives_ahead,  # and the evaluation's forward-only steps
    )


def build_evaluators(
    chunks: list[GPTModel],
    executor: PipelineExecutor,
    data: BatchSources,
    configs: Configs,
    state: ParallelState,
    after: Callable[[], None] | None = None,
) -> dict[str, Evaluator]:
    """An evaluator per split that has data ("valid", "test"); none with --eval-iters 0. They
    run forward-only at the full global batch, whatever the ramp-up."""
    training = configs.training
    if training.eval_iters == 0 or (data.valid is None and data.test is None):
        return {}
    forward_only = executor.for_schedule("forward-only", training.num_microbatches(state.dp.size))
    return {
        name: Evaluator(
            chunks,
            forward_only,
            source,
            state,
            global_batch_size=training.global_batch_size,
            micro_batch_size=training.micro_batch_size,
            eval_iters=training.eval_iters,
            after=after,
        )
        for name, source in (("valid", data.valid), ("test", data.test))
        if source is not None
    }
