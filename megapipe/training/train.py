"""The pre-training loop: build the model and optimizer, step, and log as Megatron-LM does."""

from __future__ import annotations

import time

import torch

from megapipe.config import Configs
from megapipe.data.mock import MockGPTDataset
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.training.interval_stats import IntervalStats
from megapipe.training.log_format import iteration_line, parameter_count_line, world_size_line
from megapipe.training.printing import print_rank_0, print_rank_last
from megapipe.training.step import StepResult, train_step

LOSS_NAME = "lm loss"


def build_model(configs: Configs, state: ParallelState) -> GPTModel:
    """Seed this rank's random streams and build its part of the model in training mode."""
    seed = configs.training.seed
    tracker = RNGTracker(seed, state.tp_rank, state.pp_rank, state.device)
    tracker.seed_default()
    model = GPTModel(
        configs.model,
        state,
        tracker,
        seed=seed,
        sequence_parallel=configs.parallel.sequence_parallel,
    )
    model.train()
    return model


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
    model = build_model(configs, state)
    if state.dp.rank == 0:
        count = sum(p.numel() for p in model.parameters())
        print(parameter_count_line(state.tp_rank, state.pp_rank, count), flush=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=training.lr)
    data = MockGPTDataset(configs.model.vocab_size, configs.model.seq_length, training.seed)
    stats = IntervalStats()
    results: list[StepResult] = []
    interval_start = _now(state.device)
    for iteration in range(1, training.train_iters + 1):
        result = train_step(model, optimizer, data, configs, state, iteration - 1)
        results.append(result)
        stats.add({LOSS_NAME: result.lm_loss}, skipped=result.skipped)
        if iteration % training.log_interval == 0:
            now = _now(state.device)
            line = iteration_line(
                iteration=iteration,
                train_iters=training.train_iters,
                consumed_samples=iteration * training.global_batch_size,
                elapsed_ms_per_iteration=(now - interval_start) * 1000.0 / stats.iterations,
                learning_rate=training.lr,
                global_batch_size=training.global_batch_size,
                losses=stats.averages(),
                loss_scale=1.0,
                grad_norm=result.grad_norm,
                skipped_iterations=stats.skipped_iterations,
                nan_iterations=stats.nan_iterations,
            )
            print_rank_last(state, line)
            stats.reset()
            interval_start = now
    return results
