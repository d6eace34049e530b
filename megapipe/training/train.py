"""The pre-training loop: step, maybe evaluate, maybe save, maybe stop; log as Megatron-LM does.

`train()` builds the run once (`build.py`) and runs a `TrainingLoop` over it. The loop holds
the position in the data and the learning-rate schedule; its save, evaluation and exit
decisions are methods of their own.
"""

from __future__ import annotations

import contextlib
import time

from megapipe.activity import Activity, is_communication_failure
from megapipe.checkpointing.checkpointer import Checkpointer
from megapipe.checkpointing.run_state import Progress
from megapipe.checkpointing.scheduler_rule import ScheduleSettings
from megapipe.config import Configs
from megapipe.console import print_line, say
from megapipe.conversion.megatron_lm_source import load_megatron_lm
from megapipe.model.activation_memory import SavedTensorPeak
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.stage_memory import measured_line
from megapipe.pipeline.trace import TraceRecorder, gather_and_write
from megapipe.training.build import Run, build_run
from megapipe.training.exit_conditions import ExitCheck
from megapipe.training.optimizer_schedule import OptimizerSchedule
from megapipe.training.printing import print_rank_0
from megapipe.training.profiling import profiler_for
from megapipe.training.reporting import TrainingReporter
from megapipe.training.step import GlobalBatch, StepResult, train_step
from megapipe.training.watchdog import Watchdog, WatchdogSettings

TRACE_ITERATIONS = 10  # --pipeline-trace records the first iterations only


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
    return TrainingLoop(build_run(configs, state, activity)).run()


def load_checkpoint(
    checkpoints: Checkpointer, state: ParallelState, schedule: ScheduleSettings | None = None
) -> Progress:
    """--load's checkpoint into the live run; where training continues (0 from scratch).
    `schedule`: the run's LR schedule settings, checked against the checkpoint's."""
    if checkpoints.checkpoint.load is None:
        return Progress()
    start = time.perf_counter()
    loaded = load_megatron_lm(checkpoints, schedule)  # None: not a Megatron-LM checkpoint
    progress, notes = loaded if loaded is not None else checkpoints.load(schedule)
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


def watchdog_settings(configs: Configs) -> WatchdogSettings:
    """The watchdog's bounds from its flags (max: the collectives' timeout plus a minute)."""
    parallel = configs.parallel
    longest = parallel.watchdog_max_seconds
    if longest is None:
        longest = 60.0 * parallel.distributed_timeout_minutes + 60.0
    return WatchdogSettings(
        parallel.watchdog_timeout_factor, parallel.watchdog_min_seconds, longest
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
        "context_parallel_size": parallel.context_parallel_size,
        "cp_comm_type": parallel.cp_comm_type,
    }


def _trace_peers(state: ParallelState) -> dict:
    """The global ranks a traced compute of this rank works with (TraceRecorder.peers)."""
    peers: dict = {"global_rank": state.rank}
    if state.tp.size > 1:
        peers["tp_ranks"] = list(state.tp.ranks)
    if state.cp.size > 1:
        peers["cp_ranks"] = list(state.cp.ranks)
    return peers


class TrainingLoop:
    """The loop over a built run: where it is (iteration, samples read, samples of successful
    updates), and what it decides after each iteration (evaluate, save, stop)."""

    def __init__(self, run: Run) -> None:
        """Resume from --load (if any) and start the loop's reporter, exit check and watchdog."""
        self.built, self.configs, self.state = run, run.configs, run.state
        self.training = training = run.configs.training
        self.activity = run.activity
        self.executors = {run.executor.num_microbatches: run.executor}  # per micro-batch count
        trace_path = self.configs.parallel.pipeline_trace
        self.trace = TraceRecorder(self.state.pp_rank, peers=_trace_peers(self.state)) if (
            trace_path) else None  # fmt: skip
        self.schedule = (
            OptimizerSchedule.of(training, run.configs.optimizer)
            if training.train_iters > 0
            else None
        )
        self.checkpoints = Checkpointer(
            self.configs, self.state, run.chunks, run.optimizer, run.chunks[0].rng
        )
        settings = self.schedule.settings() if self.schedule is not None else None
        progress = load_checkpoint(self.checkpoints, self.state, settings)
        if self.schedule is not None and progress.scheduler is not None:  # Megatron's rule
            self.schedule = self.schedule.following(progress.scheduler)
            run.optimizer.set_weight_decay(self.schedule.weight_decay)
        for name, evaluator in run.evaluators.items():
            evaluator.evaluations = (progress.evaluations or {}).get(name, 0)
        self.iteration = progress.iteration
        self.consumed = progress.consumed_samples  # samples read: the data position
        self.scheduled = progress.scheduled_samples  # samples of successful updates: the LR's clock
        self.saved_at = self.iteration if self.configs.checkpoint.load else None
        self._say_if_nothing_to_train()
        self.reporter = TrainingReporter(self.configs, self.state)
        self.exit_check = ExitCheck.start(training, self.state, self.activity)
        self.watchdog = Watchdog(self.activity, watchdog_settings(self.configs))
        self.results: list[StepResult] = []
        logging = self.configs.logging  # --profile: this rank's profiler, if it profiles
        self.profiler, note = profiler_for(
            logging, self.state.rank, self.state.device, self.iteration + 1
        )
        if note is not None:
            print_rank_0(self.state, f"note: {note}")

    def run(self) -> list[StepResult]:
        """Step until --train-iters or an exit condition; every iteration's result."""
        try:
            self.watchdog.start()
            self._loop()
        except RuntimeError as error:
            if is_communication_failure(error):  # a peer died or stalled: say where we were
                # at once: the launcher's SIGTERM, on its way since the peer died, would end
                # the cleanup below without a word (the teardown report is closed there)
                failure = self.activity.failure(error)
                say(f"megapipe: {failure}")
                failure.said = True
                raise failure from error
            raise
        finally:
            self._close()
        self._write_trace()
        if self.configs.logging.tensorboard_dir is not None:
            print_rank_0(self.state, f"TensorBoard logs in {self.configs.logging.tensorboard_dir}")
        return self.results

    def _loop(self) -> None:
        """Step, maybe evaluate, maybe save, maybe stop; at the end, save and evaluate."""
        training = self.training
        while not training.skip_train and self.iteration < training.train_iters:
            self.step()
            self.evaluate_at_interval()
            self.save_at_interval()
            if self.exit_early():
                return
        if not training.skip_train:  # the run's end, not an early exit: a last save
            self.save()
        self.final_evaluations()  # Megatron's, on the validation and test splits

    def step(self) -> None:
        """The next iteration, at the global batch size the ramp-up gives, and its report."""
        run, training, state = self.built, self.training, self.state
        self.iteration += 1
        self.activity.begin("step", self.iteration)
        batch_size = run.batch_sizes.global_batch_size_at(self.consumed)
        batch = GlobalBatch(self.consumed, batch_size, training.micro_batch_size, state)
        executor = self._executor_for(batch.num_microbatches)
        trace = self._trace_for_step()
        if self.profiler is not None:
            self.profiler.begin(self.iteration)
        self.reporter.start_iteration()
        measuring = run.stage_memory is not None and not self.results  # this run's first
        params = (p for c in run.chunks for p in c.parameters())
        saved = SavedTensorPeak(params) if measuring else None
        with saved or contextlib.nullcontext():
            result = train_step(
                run.chunks,
                run.optimizer,
                executor,
                run.data.train,
                batch,
                state,
                lr=self._lr(),
                iteration=self.iteration,
                trace=trace,
                decoupled_lr=self.schedule.rates(self.scheduled)[1],
                count_zeros=self.configs.logging.log_num_zeros_in_grad,
                params_norm=self.configs.logging.log_params_norm,
            )
        if self.profiler is not None:
            self.profiler.end(self.iteration)
        if saved is not None and state.dp_cp.rank == 0 and state.tp.rank == 0:
            estimate = run.stage_memory[state.pp.rank]
            print_line(measured_line(state.rank, estimate, saved.peak, state.device))
        self.results.append(result)
        self.consumed += batch_size
        self.scheduled += 0 if result.skipped else batch_size  # Megatron skips skipped steps
        scaler = run.optimizer.scaler
        scale = scaler.scale if scaler is not None else 1.0
        self.reporter.end_iteration(
            self.iteration,
            self.consumed,
            batch_size,
            result,
            self._lr(),
            scale,
            self.schedule.rates(self.scheduled)[1],
        )

    def evaluate_at_interval(self) -> None:
        """The validation split's evaluation every --eval-interval iterations."""
        valid, interval = self.built.evaluators.get("valid"), self.training.eval_interval
        if valid and interval and self.iteration % interval == 0:
            self.activity.begin("evaluation", self.iteration)
            losses = valid.evaluate()
            self.reporter.validation(
                f"iteration {self.iteration}", losses, self.iteration, self.consumed
            )

    def final_evaluations(self) -> None:
        """Megatron's evaluations after training: the validation, then the test split."""
        for name, label in (("valid", "validation"), ("test", "test")):
            evaluator = self.built.evaluators.get(name)
            if evaluator is not None:
                self.activity.begin("evaluation", self.iteration)
                losses = evaluator.evaluate()
                prefix = f"iteration {self.iteration} on {label} set"
                self.reporter.validation(prefix, losses, self.iteration, self.consumed)

    def save_at_interval(self) -> None:
        """A save every --save-interval iterations."""
        interval = self.configs.checkpoint.save_interval
        if interval and self.iteration % interval == 0:
            self.save()

    def save(self) -> None:
        """Save this iteration to --save (collective), unless saved or loaded at it already."""
        if self.configs.checkpoint.save is None or self.saved_at == self.iteration:
            return
        self.activity.begin("save", self.iteration)
        self.activity.enter("save", "the checkpoint save of iteration {}", self.iteration)
        evaluations = {name: e.evaluations for name, e in self.built.evaluators.items()}
        self.built.optimizer.finish_param_sync()  # --overlap-param-gather: no stale shard is saved
        settings = self.schedule.settings().values if self.schedule is not None else None
        progress = Progress(self.iteration, self.consumed, self.scheduled, evaluations, settings)
        save_checkpoint(self.checkpoints, self.state, progress)
        self.saved_at = self.iteration

    def exit_early(self) -> bool:
        """Whether an exit condition holds after this iteration (then save first, as Megatron
        does, and say why)."""
        reason = self.exit_check.reason(self.iteration)
        if reason is None:
            return False
        self.save()
        print_rank_0(self.state, reason)
        return True

    def _say_if_nothing_to_train(self) -> None:
        """One line when the loaded checkpoint is already at or past --train-iters."""
        training = self.training
        if training.skip_train or self.iteration == 0 or self.iteration < training.train_iters:
            return
        print_rank_0(
            self.state,
            f"nothing to train: the checkpoint loaded from {self.configs.checkpoint.load} is at "
            f"iteration {self.iteration}, already at or past --train-iters {training.train_iters}",
        )

    def _executor_for(self, num_microbatches: int) -> PipelineExecutor:
        """The executor for this many micro-batches (a ramp-up changes it)."""
        if num_microbatches not in self.executors:
            self.executors[num_microbatches] = self.built.executor.for_schedule(
                self.configs.parallel.schedule, num_microbatches
            )
        return self.executors[num_microbatches]

    def _lr(self) -> float:
        """The learning rate at the samples of successful updates so far."""
        return self.schedule.rates(self.scheduled)[0]

    def _trace_for_step(self) -> TraceRecorder | None:
        """--pipeline-trace's recorder for the first iterations, None after."""
        if self.trace is None or self.iteration > TRACE_ITERATIONS:
            return None
        self.trace.step = self.iteration
        return self.trace

    def _close(self) -> None:
        """Stop the profiler, the exit check, the reporter and a background save; then the
        watchdog."""
        try:
            if self.profiler is not None:
                self.profiler.close()
            self.exit_check.close()
            self.reporter.close()
            self.checkpoints.finish()  # a background save still in flight: watched too
        finally:
            self.activity.begin("done", self.iteration)
            self.watchdog.stop()

    def _write_trace(self) -> None:
        """--pipeline-trace's file (collective: only when every rank got here)."""
        if self.trace is not None and self.results:
            path = self.configs.parallel.pipeline_trace
            gather_and_write(
                self.trace, path, self.state.pp.ranks, _trace_metadata(self.configs, self.state)
            )
            print_rank_0(self.state, f"pipeline trace written to {path}")
