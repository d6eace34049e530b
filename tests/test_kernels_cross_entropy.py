"""The chunked vocabulary-parallel cross-entropy (torch chunks and Triton kernels) against
megapipe's existing `vocab_parallel_cross_entropy` (its reference) and against torch's
cross-entropy on the gathered logits in float64, at TP=1 and on 2 forked gloo ranks; the
collectives it issues, counted at torch.distributed; and the bytes it saves for backward."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.kernels import cross_entropy as ce
from megapipe.kernels.availability import triton_probe
from megapipe.model.activation_memory import saved_activation_bytes
from megapipe.parallel.state import Group, ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error

TRITON = triton_probe()
TOL = 1e-5
S, B = 5, 3  # sequence, micro-batch: 15 tokens


def _impls(triton: bool) -> dict:
    """name -> fn(logits, target, group, start, vocab_size); chunk / block sizes of 8 columns,
    so that no local vocabulary below is a multiple of them."""
    impls = {
        "reference": ce.cross_entropy_reference,
        "chunked": functools.partial(ce.chunked_cross_entropy, chunk_size=8),
    }
    if triton:
        impls["triton"] = functools.partial(ce.chunked_cross_entropy_triton, block_size=8)
    return impls


def _problem(padded: int, vocab_size: int, scale: float = 3.0):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, padded, generator=gen, dtype=torch.float64) * scale
    logits[..., vocab_size:] += 5.0  # padding logits large: they must still take no mass
    target = torch.randint(0, vocab_size, (B, S), generator=gen).t()  # gpt.py passes labels.t()
    grad_loss = torch.rand(S, B, generator=gen, dtype=torch.float64)
    return logits, target, grad_loss


def _float64_truth(logits, target, grad_loss, vocab_size):
    """torch's cross-entropy over the real vocabulary, float64; padding columns' grad is 0."""
    real = logits[..., :vocab_size].detach().clone().requires_grad_()
    loss = F.cross_entropy(real.reshape(-1, vocab_size), target.reshape(-1), reduction="none")
    loss = loss.view(S, B)
    (loss * grad_loss).sum().backward()
    grad = torch.zeros_like(logits)
    grad[..., :vocab_size] = real.grad
    return loss.detach(), grad


class _Counter:
    """Counts torch.distributed's collectives by (phase, name) in this (forked) rank."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
    NAMES += tuple(n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n))

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.phase = "forward"
        for name in self.NAMES:
            setattr(dist, name, self._counting(getattr(dist, name), name))

    def _counting(self, original, name):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.counts[(self.phase, name)] += 1
            return original(*args, **kwargs)

        return wrapper


def _compare(rank, world, group, padded, vocab_size, scale, triton, counter=None):
    """Per implementation: (loss error vs reference, grad error vs reference, loss error vs
    float64, grad error vs float64, forward and backward collectives)."""
    logits, target, grad_loss = _problem(padded, vocab_size, scale)
    truth_loss, truth_grad = _float64_truth(logits, target, grad_loss, vocab_size)
    local = padded // world
    start = rank * local
    mine = logits[..., start : start + local].float()
    results, outputs = {}, {}
    for name, fn in _impls(triton).items():
        leaf = mine.clone().requires_grad_()
        if counter is not None:
            counter.counts.clear()
            counter.phase = "forward"
        loss = fn(leaf, target, group, start, vocab_size)
        if counter is not None:
            counter.phase = "backward"
        (loss * grad_loss.float()).sum().backward()
        outputs[name] = loss.detach(), leaf.grad
        counts = dict(counter.counts) if counter is not None else {}
        results[name] = [
            relative_error(loss, truth_loss),
            relative_error(leaf.grad, truth_grad[..., start : start + local]),
            counts,
        ]
    for name, (loss, grad) in outputs.items():
        results[name][:0] = [
            relative_error(loss, outputs["reference"][0]),
            relative_error(grad, outputs["reference"][1]),
        ]
    return results


def _check(results_per_rank, expect_forward_gathers: int) -> None:
    for rank, results in enumerate(results_per_rank):
        for name, (vs_ref_loss, vs_ref_grad, vs_64_loss, vs_64_grad, counts) in results.items():
            print(
                f"rank {rank} {name}: vs reference loss {vs_ref_loss:.2e} grad {vs_ref_grad:.2e};"
                f" vs float64 loss {vs_64_loss:.2e} grad {vs_64_grad:.2e}; collectives {counts}"
            )
            assert max(vs_ref_loss, vs_ref_grad, vs_64_loss, vs_64_grad) < TOL, (rank, name)
            gather = (
                "all_gather_single"
                if hasattr(dist, "all_gather_single")
                else ("all_gather_into_tensor")
            )
            assert counts == (
                {("forward", gather): expect_forward_gathers} if expect_forward_gathers else {}
            ), counts  # [max, sum, target logit] stacked, gathered once; nothing in backward


@pytest.mark.parametrize("scale", [3.0, 1e4])  # 1e4: the max-shift keeps it finite
def test_tp1_matches_reference_and_float64(scale):
    """Vocabulary 37 padded to 40: chunks of 8 end ragged; 3 padding columns."""
    results = _compare(0, 1, Group.single(), 40, 37, scale, TRITON.available)
    _check([results], expect_forward_gathers=0)


def _tp2(rank, world, padded, vocab_size, triton):
    counter = _Counter()
    group = ParallelState.build(world).tp
    return _compare(rank, world, group, padded, vocab_size, 3.0, triton, counter)


@pytest.mark.parametrize(
    "padded, vocab_size",
    [(40, 37), (40, 9)],  # 37: rank 1 holds 17 real + 3 padding; 9: rank 1 only padding
)
def test_tp2_matches_reference_and_float64_with_one_all_gather(padded, vocab_size):
    """Every implementation, the reference too, issues one collective in forward."""
    results = run_distributed(_tp2, 2, padded, vocab_size, TRITON.available)
    _check(results, expect_forward_gathers=1)


def _saved(fn, logits, target):
    leaf = logits.clone().requires_grad_()
    return saved_activation_bytes(lambda: fn(leaf, target, Group.single(), 0, 250), [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_the_logits_and_two_numbers_per_token_not_the_softmax(dtype):
    tokens, vocab = 64, 256
    logits = torch.randn(8, 8, vocab).to(dtype)
    target = torch.randint(0, 250, (8, 8))
    chunked = _saved(functools.partial(ce.chunked_cross_entropy, chunk_size=64), logits, target)
    reference = _saved(ce.cross_entropy_reference, logits, target)
    logits_bytes = logits.numel() * logits.element_size()
    print(
        f"{dtype}: saved for backward: chunked {chunked} B (logits {logits_bytes} B + "
        f"{(chunked - logits_bytes) / tokens:.0f} B per token), existing {reference} B"
    )
    assert chunked == logits_bytes + tokens * (8 + 4)  # + int64 local target, fp32 lse
    assert reference >= tokens * 250 * 4  # the fp32 (log-)softmax of the 250 real ids
    if TRITON.available:
        triton_bytes = _saved(ce.chunked_cross_entropy_triton, logits[:1, :2], target[:1, :2])
        assert triton_bytes == logits[:1, :2].numel() * logits.element_size() + 2 * 12


def test_bf16_logits_give_fp32_math_and_bf16_grads():
    logits, target, grad_loss = _problem(40, 37)
    results = {}
    for name, fn in _impls(False).items():
        leaf = logits.to(torch.bfloat16).requires_grad_()
        loss = fn(leaf, target, Group.single(), 0, 37)
        (loss * grad_loss.float()).sum().backward()
        results[name] = loss, leaf.grad
    (loss, grad), (ref_loss, ref_grad) = results["chunked"], results["reference"]
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert relative_error(loss, ref_loss) < TOL
    assert relative_error(grad, ref_grad) < 1e-2  # one bf16 rounding


def test_mismatched_target_is_refused():
    with pytest.raises(ValueError, match="does not match logits"):
        ce.chunked_cross_entropy(torch.zeros(4, 2, 8), torch.zeros(2, 4, dtype=torch.long), None)
