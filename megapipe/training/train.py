"""The pre-training loop: build the model and optimizer, step, and log as Megatron-LM does."""

from __future__ import annotations

import time

import torch

from megapipe.config import Configs
from megapipe.data.sources import build_batch_source
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.loss_scaler import make_loss_scaler
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import StageMap, partition_layers
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.trace import TraceRecorder, gather_and_write
from megapipe.training.interval_stats import IntervalStats
from megapipe.training.log_format import iteration_line, parameter_count_line, world_size_line
from megapipe.training.printing import print_rank_0, print_rank_last
from megapipe.training.step import StepResult, train_step

LOSS_NAME = "lm loss"
TRACE_ITERATIONS = 10  # --pipeline-trace records the first iterations only


def build_model_chunks_for(
    configs: Configs, state: ParallelState, stage_map: StageMap | None = None
) -> list[GPTModel]:
    """Seed this rank's random streams and build its model chunks in training mode."""
    seed = configs.training.seed
    tracker = RNGTracker(seed, state.tp_rank, state.pp_rank, state.device)
    tracker.seed_default()
    chunks = build_model_chunks(
        configs.model,
        state,
        tracker,
        stage_map or stage_map_for(configs),
        seed=seed,
        sequence_parallel=configs.parallel.sequence_parallel,
    )
    for chunk in chunks:
        chunk.to(configs.optimizer.params_dtype)
        chunk.train()
    return chunks


def stage_map_for(configs: Configs) -> StageMap:
    parallel = configs.parallel
    return partition_layers(
        configs.model,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        method=parallel.pipeline_partition,
        first=parallel.decoder_first_pipeline_num_layers,
        last=parallel.decoder_last_pipeline_num_layers,
    )


def build_optimizer(
    chunks: list[GPTModel], configs: Configs, state: ParallelState
) -> ShardedOptimizer:
    """Gradient buffers for every chunk, and the (possibly sharded) mixed-precision optimizer."""
    opt = configs.optimizer
    num_microbatches = configs.training.num_microbatches(state.dp.size)
    buffers = [
        GradBuffer(
            list(chunk.parameters()),
            state.dp,
            num_microbatches=num_microbatches,
            bucket_size=opt.ddp_bucket_size,
            overlap=opt.overlap_grad_reduce,
            shard=opt.use_distributed_optimizer,
            solo=[p for p in [chunk.shared_word_embedding()] if p is not None],
        )
        for chunk in chunks
    ]
    scaler = make_loss_scaler(
        fp16=opt.fp16,
        loss_scale=opt.loss_scale if opt.fp16 else None,
        initial_loss_scale=opt.initial_loss_scale,
        min_loss_scale=opt.min_loss_scale,
        loss_scale_window=opt.loss_scale_window,
        hysteresis=opt.hysteresis,
    )
    return ShardedOptimizer(buffers, state, opt, configs.training.lr, scaler)


def build_executor(
    chunks: list[GPTModel], configs: Configs, state: ParallelState
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
        comm=P2PCommunicator(state.pp, parallel.pipeline_p2p_timeout),
        batch_on_every_stage=configs.data.reset_attention_mask,
    )


def _trace_metadata(configs: Configs, state: ParallelState) -> dict:
    """What a trace's reader needs to title it: the schedule and its sizes."""
    parallel = configs.parallel
    return {
        "schedule": parallel.schedule,
        "pipeline_size": parallel.pipeline_model_parallel_size,
        "virtual_stages": parallel.virtual_pipeline_model_parallel_size,
        "num_microbatches": configs.training.num_microbatches(state.dp.size),
    }


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train(configs: Configs, state: ParallelState) -> list[StepResult]:
    """Train for --train-iters iterations; returns every iteration's result (same on all ranks).

    Prints Megatron's start-up lines, then one log line per --log-interval iterations from the
    last rank, with losses averaged over the interval.
    """
    training = configs.training
    print_rank_0(
        state,
        world_size_line(state.world_size, state.dp.size, state.tp.size, state.pp.size),
    )
    stage_map = stage_map_for(configs)
    if state.pp.size > 1:
        print_rank_0(state, stage_map.describe())
    chunks = build_model_chunks_for(configs, state, stage_map)
    params = [p for chunk in chunks for p in chunk.parameters()]
    if state.dp.rank == 0:
        count = sum(p.numel() for p in params)
        print(parameter_count_line(state.tp_rank, state.pp_rank, count), flush=True)

    trace_path = configs.parallel.pipeline_trace
    trace = TraceRecorder(state.pp_rank) if trace_path else None
    executor = build_executor(chunks, configs, state)
    optimizer = build_optimizer(chunks, configs, state)
    data = build_batch_source(configs)  # mock samples, or --data-path's (rank 0 builds indices)
    stats = IntervalStats()
    results: list[StepResult] = []
    schedule = training.lr_schedule()
    updates = 0  # successful optimizer steps: what the learning-rate schedule counts
    interval_start = _now(state.device)
    for iteration in range(1, training.train_iters + 1):
        step_trace = trace if iteration <= TRACE_ITERATIONS else None  # None without the flag
        if step_trace is not None:
            step_trace.step = iteration
        result = train_step(
            chunks,
            optimizer,
            executor,
            data,
            configs,
            state,
            iteration - 1,
            schedule.lr_at(updates),
            trace=step_trace,
        )
        results.append(result)
        updates += not result.skipped  # Megatron's scheduler does not advance on skipped steps
        stats.add({LOSS_NAME: result.lm_loss}, skipped=result.skipped)
        if iteration % training.log_interval == 0:
            now = _now(state.device)
            line = iteration_line(
                iteration=iteration,
                train_iters=training.train_iters,
                consumed_samples=iteration * training.global_batch_size,
                elapsed_ms_per_iteration=(now - interval_start) * 1000.0 / stats.iterations,
                learning_rate=schedule.lr_at(updates),
                global_batch_size=training.global_batch_size,
                losses=stats.averages(),
                loss_scale=optimizer.scaler.scale if optimizer.scaler is not None else 1.0,
                grad_norm=result.grad_norm,
                skipped_iterations=stats.skipped_iterations,
                nan_iterations=stats.nan_iterations,
            )
            print_rank_last(state, line)
            stats.reset()
            interval_start = now
    if trace is not None:
        gather_and_write(trace, trace_path, state.pp.ranks, _trace_metadata(configs, state))
        print_rank_0(state, f"pipeline trace written to {trace_path}")
    return results
