"""The pre-training loop: build the model and optimizer, step, evaluate, log as Megatron-LM does."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from megapipe.activity import Activity, is_communication_failure
from megapipe.checkpointing.checkpointer import Checkpointer
from megapipe.checkpointing.run_state import Progress
from megapipe.config import Configs
from megapipe.console import print_line
from megapipe.data.sources import BatchSources, build_batch_sources
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.loss_scaler import make_loss_scaler
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.layers.linear import set_tp_comm_overlap
from megapipe.model.activation_memory import SavedTensorPeak
from megapipe.model.attention_backends import check_attention_backend, describe_attention
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import StageMap
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.stage_memory import MemoryModel, measured_line, plan_stages
from megapipe.pipeline.stage_memory import describe as describe_stage_memory
from megapipe.pipeline.trace import TraceRecorder, gather_and_write
from megapipe.training.batch_size import BatchSizeSchedule, batch_size_schedule_of
from megapipe.training.evaluation import Evaluator
from megapipe.training.exit_conditions import ExitCheck
from megapipe.training.faults import FaultPlan
from megapipe.training.log_format import parameter_count_line, world_size_line
from megapipe.training.lr_schedule import lr_schedule_of
from megapipe.training.printing import print_rank_0
from megapipe.training.reporting import TrainingReporter
from megapipe.training.step import GlobalBatch, StepResult, train_step
from megapipe.training.watchdog import Watchdog, WatchdogSettings

TRACE_ITERATIONS = 10  # --pipeline-trace records the first iterations only


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
    for chunk in chunks:
        chunk.to(configs.optimizer.params_dtype)
        chunk.train()
        set_tp_comm_overlap(chunk, configs.parallel.tp_comm_overlap)
    return chunks


def stage_map_for(configs: Configs) -> StageMap:
    """The run's layer split over pipeline stages (--pipeline-partition)."""
    return plan_stages(
        configs.model,
        configs.parallel,
        micro_batch_size=configs.training.micro_batch_size,
        num_microbatches=configs.training.num_microbatches(configs.data_parallel_size),
        optimizer=configs.optimizer,
        recompute=configs.recompute,
        data_parallel_size=configs.data_parallel_size,
    )


def build_optimizer(
    chunks: list[GPTModel],
    configs: Configs,
    state: ParallelState,
    activity: Activity | None = None,
) -> ShardedOptimizer:
    """Gradient buffers for every chunk, and the (possibly sharded) mixed-precision optimizer;
    `activity` records what they wait in."""
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
            solo=_solo_tied_embedding(chunk, state, opt.use_distributed_optimizer),
            activity=activity,
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


def _trace_metadata(configs: Configs, state: ParallelState) -> dict:
    """What a trace's reader needs to title it: the schedule and its sizes."""
    parallel = configs.parallel
    return {
        "schedule": parallel.schedule,
        "pipeline_size": parallel.pipeline_model_parallel_size,
        "virtual_stages": parallel.virtual_pipeline_model_parallel_size,
        "num_microbatches": configs.training.num_microbatches(state.dp.size),
        "receives_ahead": parallel.pipeline_receives_ahead,
    }


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


def load_checkpoint(checkpoints: Checkpointer, state: ParallelState) -> Progress:
    """--load's checkpoint into the live run; where training continues (0 from scratch)."""
    if checkpoints.checkpoint.load is None:
        return Progress()
    start = time.perf_counter()
    progress, notes = checkpoints.load()
    for note in notes:
        print_rank_0(state, f" {note}")
    if progress is None:
        return Progress()
    print_rank_0(
        state,
        f"  successfully loaded checkpoint from {checkpoints.checkpoint.load} at iteration "
        f"{progress.iteration} in {time.perf_counter() - start:.2f} s",
    )
    return progress


def save_checkpoint(checkpoints: Checkpointer, state: ParallelState, progress: Progress) -> None:
    """Megatron's two lines around a save (collective)."""
    save = checkpoints.checkpoint.save
    print_rank_0(state, f"saving checkpoint at iteration {progress.iteration:7d} to {save}")
    directory, held_up = checkpoints.save(progress)
    how = "started writing (in the background)" if checkpoints.saver else "successfully saved"
    print_rank_0(
        state,
        f"  {how} checkpoint from iteration {progress.iteration:7d} to {directory}; "
        f"training held up {held_up:.2f} s",
    )


def build_evaluators(
    chunks: list[GPTModel],
    executor: PipelineExecutor,
    data: BatchSources,
    configs: Configs,
    state: ParallelState,
) -> dict[str, Evaluator]:
    """An evaluator per split that has data ("valid", "test"); none with --eval-iters 0. They
    run forward-only at the full global batch, whatever the ramp-up."""
    training = configs.training
    if training.eval_iters == 0:
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
        )
        for name, source in (("valid", data.valid), ("test", data.test))
        if source is not None
    }


def watchdog_settings(configs: Configs) -> WatchdogSettings:
    """The watchdog's bounds from its flags (max: the collectives' timeout plus a minute)."""
    parallel = configs.parallel
    longest = parallel.watchdog_max_seconds
    if longest is None:
        longest = 60.0 * parallel.distributed_timeout_minutes + 60.0
    return WatchdogSettings(
        parallel.watchdog_timeout_factor, parallel.watchdog_min_seconds, longest
    )


def train(
    configs: Configs, state: ParallelState, activity: Activity | None = None
) -> list[StepResult]:
    """Train for --train-iters iterations (evaluating every --eval-interval), then evaluate on
    the validation and test splits; returns every iteration's result (same on all ranks).

    `activity` records what this rank is doing for the watchdog and for errors (default: a new
    one, with the fault plan of MEGAPIPE_FAULT when set, see training/faults.py). A collective
    that fails under this rank (a peer died or timed out) raises RankFailure naming the
    operation this rank was in.

    Prints Megatron's start-up lines, one log line per --log-interval iterations from the last
    rank (losses averaged over the interval), and a validation block per evaluation. Stops
    early, on every rank after the same iteration, for --exit-interval,
    --exit-duration-in-mins or SIGTERM with --exit-signal-handler (no final evaluation then).
    """
    training = configs.training
    activity = activity or Activity(state, FaultPlan.from_env(os.environ, state.rank))
    print_rank_0(
        state,
        world_size_line(state.world_size, state.dp.size, state.tp.size, state.pp.size),
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
    stage_map = stage_map_for(configs)
    memory = (
        MemoryModel.of(configs, state.device.type).stages(stage_map) if state.pp.size > 1 else None
    )
    if memory is not None:
        print_rank_0(state, stage_map.describe())
        print_rank_0(state, describe_stage_memory(memory))
    chunks = build_model_chunks_for(configs, state, stage_map)
    print_rank_0(state, chunks[0].kernel_choices.describe())
    print_rank_0(state, describe_attention(
        configs.kernels.attention_backend, configs.kernels.attention_dropout_rng, state.device,
        configs.optimizer.params_dtype, attention_dropout=configs.model.attention_dropout,
        reset_attention_mask=configs.data.reset_attention_mask,
        softmax=chunks[0].kernel_choices.chosen["masked_softmax"]))  # fmt: skip
    if state.dp.rank == 0:
        count = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        print_line(parameter_count_line(state.tp_rank, state.pp_rank, count))

    trace_path = configs.parallel.pipeline_trace
    trace = TraceRecorder(state.pp_rank) if trace_path else None
    executor = build_executor(chunks, configs, state, activity)
    optimizer = build_optimizer(chunks, configs, state, activity)
    batch_sizes = batch_size_schedule_of(training, state.dp.size)
    counts = SampleCounts.of(configs, batch_sizes)
    data = build_batch_sources(  # mock samples, or the splits of --data-path (rank 0 indexes)
        configs, train_samples=counts.train, valid_samples=counts.valid, test_samples=counts.test
    )
    evaluators = build_evaluators(chunks, executor, data, configs, state)
    executors = {executor.num_microbatches: executor}
    lr_schedule = lr_schedule_of(training) if training.train_iters > 0 else None
    checkpoints = Checkpointer(configs, state, chunks, optimizer, chunks[0].rng)
    progress = load_checkpoint(checkpoints, state)
    for name, evaluator in evaluators.items():
        evaluator.evaluations = (progress.evaluations or {}).get(name, 0)
    reporter = TrainingReporter(configs, state)
    exit_check = ExitCheck.start(training, state, activity)
    watchdog = Watchdog(activity, watchdog_settings(configs))
    results: list[StepResult] = []
    iteration = progress.iteration
    consumed = progress.consumed_samples  # samples read: the data position
    scheduled = progress.scheduled_samples  # samples of successful updates: the LR's clock
    saved_at = iteration if configs.checkpoint.load else None

    def save() -> None:
        nonlocal saved_at
        if configs.checkpoint.save is not None and saved_at != iteration:
            activity.begin("save", iteration)
            activity.enter("save", "the checkpoint save of iteration {}", iteration)
            evaluations = {name: e.evaluations for name, e in evaluators.items()}
            optimizer.finish_param_sync()  # --overlap-param-gather: no stale shard is saved
            save_checkpoint(
                checkpoints, state, Progress(iteration, consumed, scheduled, evaluations)
            )
            saved_at = iteration

    try:
        watchdog.start()
        while not training.skip_train and iteration < training.train_iters:
            iteration += 1
            activity.begin("step", iteration)
            batch_size = batch_sizes.global_batch_size_at(consumed)
            batch = GlobalBatch(consumed, batch_size, training.micro_batch_size, state)
            m = batch.num_microbatches
            if m not in executors:
                executors[m] = executor.for_schedule(configs.parallel.schedule, m)
            step_trace = trace if iteration <= TRACE_ITERATIONS else None
            if step_trace is not None:
                step_trace.step = iteration
            reporter.start_iteration()
            measuring = memory is not None and not results  # the first iteration of this run
            saved = (
                SavedTensorPeak(p for c in chunks for p in c.parameters()) if measuring else None
            )
            with saved or contextlib.nullcontext():
                result = train_step(
                    chunks,
                    optimizer,
                    executors[m],
                    data.train,
                    batch,
                    state,
                    lr=lr_schedule.lr_at(scheduled / training.global_batch_size),
                    iteration=iteration,
                    trace=step_trace,
                )
            if saved is not None and state.dp.rank == 0 and state.tp.rank == 0:
                line = measured_line(state.rank, memory[state.pp.rank], saved.peak, state.device)
                print_line(line)
            results.append(result)
            consumed += batch_size
            scheduled += 0 if result.skipped else batch_size  # Megatron skips skipped steps
            scale = optimizer.scaler.scale if optimizer.scaler is not None else 1.0
            lr = lr_schedule.lr_at(scheduled / training.global_batch_size)
            reporter.end_iteration(iteration, consumed, batch_size, result, lr, scale)
            valid = evaluators.get("valid")
            if valid and training.eval_interval and iteration % training.eval_interval == 0:
                activity.begin("evaluation", iteration)
                losses = valid.evaluate()
                reporter.validation(f"iteration {iteration}", losses, iteration, consumed)
            interval = configs.checkpoint.save_interval
            if interval and iteration % interval == 0:
                save()
            reason = exit_check.reason(iteration)
            if reason is not None:
                save()  # Megatron saves before an early exit
                print_rank_0(state, reason)
                break
        else:  # the run's end, not an early exit: a last save, Megatron's final evaluations
            if not training.skip_train:
                save()
            for name, label in (("valid", "validation"), ("test", "test")):
                if name in evaluators:
                    activity.begin("evaluation", iteration)
                    losses = evaluators[name].evaluate()
                    prefix = f"iteration {iteration} on {label} set"
                    reporter.validation(prefix, losses, iteration, consumed)
    except RuntimeError as error:
        if is_communication_failure(error):  # a peer died or stalled: say where we were
            raise activity.failure(error) from error
        raise
    finally:
        try:
            exit_check.close()
            reporter.close()
            checkpoints.finish()  # a background save still in flight: watched too
        finally:
            activity.begin("done", iteration)
            watchdog.stop()
    if trace is not None and results:  # collective: only when every rank got here
        gather_and_write(trace, trace_path, state.pp.ranks, _trace_metadata(configs, state))
        print_rank_0(state, f"pipeline trace written to {trace_path}")
    if configs.logging.tensorboard_dir is not None:
        print_rank_0(state, f"TensorBoard logs in {configs.logging.tensorboard_dir}")
    return results


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
