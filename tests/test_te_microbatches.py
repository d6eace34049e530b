"""TransformerEngine's FP8 autocast and weight-cast caching, wired on CPU through the
plain-torch TE stand-in (tests/te_stub.py; real TE needs CUDA, tests/test_transformer_engine.py
runs it where installed).

- the autocast is entered once per model chunk forward (it was once per TE module: 4 per
  layer), and once per recomputed piece in backward (whose TE forwards run outside the chunk's);
  every TE forward runs inside one;
- each TE module gets `is_first_microbatch` True on its first forward of a training step or an
  evaluation and False after, through the product's own train_step and Evaluator.

What only a GPU with TE can show (not checked here): that TE then really reuses its fp8 weight
casts, and the amax reduction count per step.
"""

from __future__ import annotations

import pytest
import te_stub
import torch

from megapipe.arguments import parse_args
from megapipe.config import KernelConfig, ModelConfig, RecomputeConfig
from megapipe.data.sources import build_batch_sources
from megapipe.kernels.dispatch import IMPLEMENTATIONS, KernelChoices
from megapipe.model.gpt import GPTModel
from megapipe.model.te_layers import start_microbatches
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.training.build import build_executor, build_optimizer
from megapipe.training.evaluation import Evaluator
from megapipe.training.step import GlobalBatch, train_step

GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=8,
            attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip
REFERENCE = KernelChoices("cpu", {op: "reference" for op in IMPLEMENTATIONS}, {}, IMPLEMENTATIONS)


@pytest.fixture
def stub_te(monkeypatch):
    te_stub.install(monkeypatch)


FP8 = KernelConfig(transformer_impl="transformer_engine", fp8_format="hybrid")


def _te_model(kernels: KernelConfig, recompute: RecomputeConfig | None = None) -> GPTModel:
    model = GPTModel(ModelConfig(**GPT2), ParallelState.single(), RNGTracker(5), seed=5,
                     kernels=kernels, kernel_choices=REFERENCE, recompute=recompute)  # fmt: skip
    return model.train()


@pytest.mark.parametrize(
    ("recompute", "in_backward", "rerun"),
    [
        (None, 0, 0),
        (RecomputeConfig("full", "uniform", 1), 2, 8),  # each recomputed layer: one autocast
        (RecomputeConfig("full", "uniform", 2), 1, 8),  # the group of both layers: one
        (RecomputeConfig("selective", modules=("mlp",)), 2, 4),  # each layer's MLP: one
    ],
    ids=["none", "full-1", "full-2", "selective-mlp"],
)
def test_fp8_autocast_once_per_chunk_forward_and_per_recomputed_piece(
    stub_te, recompute, in_backward, rerun
) -> None:
    """in_backward: autocasts entered by the backward's recomputations (outside the chunk's);
    rerun: TE module forwards those recomputations run again (before: one autocast each)."""
    model = _te_model(FP8, recompute)
    tokens = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(tokens=tokens, labels=tokens).mean()
    assert len(te_stub.AUTOCASTS) == 1 and model.decoder.fp8.entries == 1
    assert len(te_stub.TE_FORWARDS) == 8  # 4 TE modules x 2 layers, under one autocast
    loss.backward()
    assert len(te_stub.AUTOCASTS) == 1 + in_backward == model.decoder.fp8.entries
    assert len(te_stub.TE_FORWARDS) == 8 + rerun
    assert all(inside for _, _, inside in te_stub.TE_FORWARDS)  # every TE forward ran in FP8
    assert model.decoder.layers["0"].mlp.linear_fc1.megapipe_fp8_scope is model.decoder.fp8


def test_is_first_microbatch_is_true_once_per_step_then_false(stub_te) -> None:
    """Each TE module casts its weights once per step (True), then reuses the cast (False)
    for the step's other micro-batches and recomputations, until `start_microbatches`."""
    model = _te_model(KernelConfig(transformer_impl="transformer_engine"))
    tokens = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(0))
    modules = [m for m in model.modules() if hasattr(m, "megapipe_first_microbatch")]
    assert len(modules) == 8  # four per layer
    for _ in range(3):  # three micro-batches of one step
        model(tokens=tokens, labels=tokens)
    flags = [[flag for m, flag, _ in te_stub.TE_FORWARDS if m is module] for module in modules]
    assert flags == [[True, False, False]] * 8
    assert start_microbatches([model]) == 8  # the next step
    te_stub.TE_FORWARDS.clear()
    model(tokens=tokens, labels=tokens)
    assert [flag for _, flag, _ in te_stub.TE_FORWARDS] == [True] * 8
    assert start_microbatches([_te_model(KernelConfig())]) == 0  # local layers: no TE module


def _steps_and_evaluation(rank: int, world: int) -> list[list[bool]]:
    """Two training steps of two micro-batches and an evaluation, through the product's
    train_step and Evaluator on a TE model; each module's flags, in order."""
    configs = parse_args([
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "50",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0",
    ], world)  # fmt: skip
    state = ParallelState.build(1, 1)
    chunks = [_te_model(KernelConfig(transformer_impl="transformer_engine"))]
    optimizer = build_optimizer(chunks, configs, state)
    executor = build_executor(chunks, configs, state)
    data = build_batch_sources(configs, train_samples=0, valid_samples=0, test_samples=0).train
    for step in range(2):
        batch = GlobalBatch(step * 2, 2, 1, state)
        train_step(chunks, optimizer, executor, data, batch, state, lr=1e-3, iteration=step + 1)
    evaluation = Evaluator(chunks, executor.for_schedule("forward-only", 2), data, state,
                           global_batch_size=2, micro_batch_size=1, eval_iters=1)  # fmt: skip
    evaluation.evaluate()
    modules = [m for m in chunks[0].modules() if hasattr(m, "megapipe_first_microbatch")]
    return [[flag for m, flag, _ in te_stub.TE_FORWARDS if m is module] for module in modules]


def test_train_step_and_evaluation_start_each_with_a_first_microbatch(stub_te) -> None:
    flags = run_distributed(_steps_and_evaluation, 1)[0]
    # step 1: True, False; step 2: True, False; the evaluation's two micro-batches: True, False
    assert flags == [[True, False, True, False, True, False]] * 8
