"""Sharded data parallelism (ZeRO-2/3 on torch's FSDP2): every layout trains to the one-rank run.

Each layout runs `pretrain_gpt.py`'s own path (train_with_flags) on the same global batches as
the one-rank reference of tests/test_parity_dp.py; every iteration's loss and grad norm must
match to 1e-5 relative (measured: ~3e-7), with clipping active (the norms exceed --clip-grad
0.5). An independent reference closes the loop: a plain-PyTorch GPT under a plain
`fully_shard` loop with torch.optim.AdamW and `clip_grad_norm_` gives megapipe's ZeRO-3 numbers.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)

from megapipe.testing import run_distributed, train_with_flags
from tests.helpers import PARITY_FLAGS, parity_losses_and_norms
from tests.test_golden_reference import (
    ARGV,
    CLIP,
    GLOBAL_BATCH,
    SEED,
    SEQ,
    STEPS,
    VOCAB,
    plain_optimizer,
    worst_relative_error,
)

TOLERANCE = 1e-5
ZERO3 = ["--use-torch-fsdp2"]
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2", "--emulate-nccl-p2p-order"]
HYBRID = ["--num-distributed-optimizer-instances", "2"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
ZB_H1 = ["--pipeline-schedule", "zero-bubble-h1"]


_train = parity_losses_and_norms


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train, 1, [])[0]


@pytest.fixture(scope="module")
def reference_with_dropout():
    return run_distributed(_train, 1, DROPOUT)[0]


LAYOUTS = {
    "dp4-zero3": (4, ZERO3),
    "dp4-zero2": (4, ZERO2),
    "dp4-zero3-prefetch": (4, ZERO3 + ["--overlap-param-gather", "--overlap-grad-reduce"]),
    "tp2-dp2-sp-zero3": (4, ZERO3 + TP2_SP),
    "tp2-dp2-sp-zero2": (4, ZERO2 + TP2_SP),
    "pp2-dp2-zero3": (4, ZERO3 + PP2),
    "pp2-dp2-zero2": (4, ZERO2 + PP2),
    "hybrid-2x2-zero3": (4, ZERO3 + HYBRID),
    "hybrid-2x2-zero2": (4, ZERO2 + HYBRID),
    "hybrid-2x2-zero1": (4, ["--use-distributed-optimizer"] + HYBRID),
    "hybrid-2x2-zero1-overlap": (4, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                     "--overlap-param-gather"] + HYBRID),
    "hybrid-4x1-zero1": (4, ["--use-distributed-optimizer",
                             "--num-distributed-optimizer-instances", "4"]),
    "pp2-hybrid-2x2-zero1": (8, ["--use-distributed-optimizer"] + HYBRID + PP2),
    "dp2-zero3-full-recompute": (2, ZERO3 + ["--recompute-granularity", "full",
                                             "--recompute-method", "uniform",
                                             "--recompute-num-layers", "2"]),
    "dp2-zero3-selective-recompute": (2, ZERO3 + ["--recompute-granularity", "selective"]),
    "tp2-pp2-dp2-interleaved-zero3": (8, ZERO3 + TP2_SP + PP2 + [
        "--num-layers-per-virtual-pipeline-stage", "1"]),
    "pp2-dp2-zb-h1-zero3": (4, ZERO3 + PP2 + ZB_H1),
    "pp2-dp2-zb-h1-zero2": (4, ZERO2 + PP2 + ZB_H1),
    "pp2-dp2-interleaved-zb-zero3": (4, ZERO3 + PP2 + [
        "--pipeline-schedule", "interleaved-zero-bubble",
        "--num-layers-per-virtual-pipeline-stage", "1"]),
}  # fmt: skip


def _assert_matches(runs, expected) -> None:
    losses, norms = expected
    for rank_losses, rank_norms in runs:
        assert rank_losses == pytest.approx(losses, rel=TOLERANCE)
        assert rank_norms == pytest.approx(norms, rel=TOLERANCE)
    assert norms[0] > 0.5  # clipping was active in the first step


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_layouts_match_one_rank(reference, layout):
    world, extra = LAYOUTS[layout]
    _assert_matches(run_distributed(_train, world, extra), reference)


def _train_reducing_per_backward(rank: int, world_size: int, extra: list[str]):
    """The control: FSDP2's own reduction at the end of each backward, as without
    `reduce_after_step`."""
    import contextlib

    from megapipe.distributed.fsdp_optimizer import FSDPOptimizer

    FSDPOptimizer.gradient_sync = lambda self, deferred: contextlib.nullcontext()
    return _train(rank, world_size, extra)


def test_zero_bubble_needs_the_reduction_after_the_step(reference):
    """Without reducing after the last W, the deferred weight gradients miss FSDP2's
    reduce-scatter (reduced a step late, with no error): the losses leave the reference."""
    losses, _ = run_distributed(_train_reducing_per_backward, 4, ZERO3 + PP2 + ZB_H1)[0]
    assert worst_relative_error(losses[1:], reference[0][1:]) > 100 * TOLERANCE


@pytest.mark.parametrize(
    "extra", [ZERO3, ZERO2 + PP2, ZERO3 + TP2_SP], ids=["dp4-zero3", "pp2-dp2-zero2", "tp2-dp2"]
)
def test_sharded_layouts_with_dropout_match_one_rank(reference_with_dropout, extra):
    """Layout-invariant dropout: every mask keyed by (seed, sample, layer, site)."""
    world = 4
    _assert_matches(run_distributed(_train, world, DROPOUT + extra), reference_with_dropout)


def _validation_losses(rank: int, world_size: int, extra: list[str]) -> list[float]:
    flags = PARITY_FLAGS + ["--eval-iters", "1", "--eval-interval", "2"] + extra
    _, out = train_with_flags(rank, world_size, flags)
    return [float(v) for v in re.findall(r"lm loss value: ([0-9.eE+-]+)", out)]


def test_evaluation_under_zero2_matches_one_rank():
    """A forward-only pass under ZeRO-2 leaves the parameters gathered for a backward that
    never comes; the evaluator frees them, and training continues to the same numbers."""
    expected = run_distributed(_validation_losses, 1, [])[0]
    assert len(expected) >= 2  # at iteration 2, iteration 4, and the final ones
    printed = [losses for losses in run_distributed(_validation_losses, 2, ZERO2) if losses]
    assert len(printed) == 1  # the rank that prints Megatron's validation lines
    assert printed[0] == pytest.approx(expected, rel=TOLERANCE)


def _unsharded_after_evaluation(rank: int, world_size: int) -> list[bool]:
    """Whether each FSDP2 module's parameters are the sharded DTensors after an evaluation."""
    from torch.distributed.tensor import DTensor

    from megapipe.arguments import parse_args
    from megapipe.parallel.state import ParallelState
    from megapipe.training.build import build_run

    flags = PARITY_FLAGS + ["--eval-iters", "1", "--eval-interval", "2"] + ZERO2
    configs = parse_args(flags, world_size)
    run = build_run(configs, ParallelState.build(), announce=False)
    run.evaluators["valid"].evaluate()
    return [isinstance(p, DTensor) for c in run.chunks for p in c.parameters()]


def test_evaluation_under_zero2_frees_the_gathered_parameters():
    for registered_sharded in run_distributed(_unsharded_after_evaluation, 2):
        assert registered_sharded and all(registered_sharded)


def _golden_megapipe(rank: int, world_size: int):
    results, _ = train_with_flags(rank, world_size, ARGV + ZERO3)
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


def _golden_plain_fsdp(rank: int, world_size: int):
    """The plain-PyTorch GPT of tests/test_golden_reference.py under a plain FSDP2 loop: every
    block and the root `fully_shard`-ed over the world, each rank its half of each global
    batch, torch's AdamW on the DTensors, `clip_grad_norm_`, the loss all-reduced."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megapipe.config import ModelConfig
    from megapipe.data.mock import MockGPTDataset
    from megapipe.model import GPTModel
    from megapipe.parallel.random import RNGTracker
    from megapipe.parallel.state import ParallelState
    from megapipe.testing.reference_gpt import reference_from_megapipe

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                         ffn_hidden_size=128, seq_length=SEQ, vocab_size=VOCAB,
                         attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip
    initial = GPTModel(config, ParallelState.single(), RNGTracker(SEED), seed=SEED)
    model = reference_from_megapipe(initial).train()
    del initial
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    optimizer, scheduler = plain_optimizer(params)
    data = MockGPTDataset(VOCAB, SEQ, SEED)
    share = GLOBAL_BATCH // world_size
    losses, norms = [], []
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + rank * share
        batch = data.batch(range(start, start + share))
        loss = model(batch.tokens, batch.labels).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses, norms


def test_zero3_trains_like_plain_pytorch_fsdp2():
    """The independent reference: megapipe's ZeRO-3 at DP2 (its layers, optimizer wrapper,
    norm and clipping) against plain PyTorch's model, FSDP2 loop and optimizer."""
    (losses, norms), _ = run_distributed(_golden_megapipe, 2)
    (ref_losses, ref_norms), _ = run_distributed(_golden_plain_fsdp, 2)
    assert sum(n > CLIP for n in ref_norms) >= 0.8 * STEPS, ref_norms  # clipping is active
    assert ref_losses[-1] < ref_losses[0] - 0.2, ref_losses
    assert worst_relative_error(losses, ref_losses) < TOLERANCE, (losses, ref_losses)
    assert worst_relative_error(norms, ref_norms) < TOLERANCE, (norms, ref_norms)
    assert all(math.isfinite(n) for n in norms)


HALF = ["--num-layers", "2", "--train-iters", "6", "--initial-loss-scale", "65536"]


def _train_half(rank: int, world_size: int, extra: list[str]):
    results, _ = train_with_flags(rank, world_size, PARITY_FLAGS + HALF + extra)
    return [(r.lm_loss, r.grad_norm, r.skipped) for r in results]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("dtype", ["--bf16", "--fp16"])
def test_half_precision_sharded_trains_like_zero1(dtype):
    """bf16/fp16 parameters and compute, fp32 reduction and optimizer state: ZeRO-3 and
    ZeRO-2 follow ZeRO-1's run of the same dtype (fp16: the loss scaler skips the same
    overflowing steps), and differ from fp32 by far more than from each other (measured,
    worst over losses and grad norms: bf16 8.9e-4 against 7.4e-3 from fp32; fp16 1.2e-4
    against 3.9e-3)."""
    zero1 = run_distributed(_train_half, 2, [dtype, "--use-distributed-optimizer"])[0]
    fp32 = run_distributed(_train_half, 2, ["--use-distributed-optimizer"])[0]
    for strategy in (ZERO3, ZERO2):
        sharded = run_distributed(_train_half, 2, [dtype] + strategy)[0]
        assert [s for *_, s in sharded] == [s for *_, s in zero1]
        kept = [(a, b) for a, b in zip(sharded, zero1) if not a[2]]
        assert len(kept) >= 3
        worst = max(_relative(a[i], b[i]) for a, b in kept for i in (0, 1))
        control = max(
            _relative(a[i], b[i]) for a, b in zip(sharded, fp32) if not a[2] for i in (0, 1)
        )
        assert worst < 2e-3, (worst, sharded, zero1)
        assert control > 3 * worst, (control, worst)


def _startup(rank: int, world_size: int, extra: list[str]) -> str:
    _, out = train_with_flags(rank, world_size, PARITY_FLAGS + ["--train-iters", "1"] + extra)
    return out


def test_the_start_up_line_names_the_strategy():
    out = "".join(run_distributed(_startup, 4, ZERO2 + HYBRID))
    assert (
        "> sharded data parallelism: ZeRO-2 (optim_grads) with torch FSDP2 over 4 data-parallel "
        "ranks (hybrid: 2 groups of 2, sharded inside each and replicated across)" in out
    )
