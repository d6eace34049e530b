"""bf16 weight gradients: the GEMMs run in bf16, the sums in the fp32 main_grad.

A bf16 GPT step (one layer, TP=1, two micro-batches into a GradBuffer) runs under a
TorchDispatchMode that records every mm/addmm/bmm/baddbmm with its operands' dtypes. A GEMM is
a weight gradient when it contracts over the step's tokens into a linear weight's shape; each
of the five linears (QKV, proj, fc1, fc2, the output layer) has one per micro-batch, and none
may run in fp32 (megapipe used to widen both factors to fp32: 10 fp32 GEMMs in this step).
The main_grads must stay within bf16 tolerance of an independent fp32 reference: the plain
PyTorch GPT (`megapipe.testing.reference_gpt`) on fp32 copies of the same weights and batches.
Tolerance 3e-2 (max error over the largest entry, per parameter): the bf16 forward rounds every
activation to 8 bits (2^-9 each), and the backward compounds a few such roundings. Measured
(CPU, torch 2.13): worst 1.25e-2 (the input norm's weight, which no GEMM of ours computes),
linear and embedding weights 7.4e-3 (7.9e-3 with the former fp32 GEMMs); a dropped
micro-batch or a factor 2 is off by 0.5 or more.

The embedding's gradient goes into its fp32 main_grad by id: a token repeated many times is
summed in fp32. Measured: 0 against float64 (the former bf16 table per micro-batch: 1.6e-3;
autograd's bf16 table and bf16 .grad, the control: 4.1e-3).

Buckets of the distributed optimizer are padded so that every DP rank's shard of every bucket
starts at a multiple of SHARD_ALIGNMENT, for DP sizes that are not powers of two too (pure
layout arithmetic: a Group without a process group builds the layout of any rank).

The last test runs only on CUDA: there the weight-gradient GEMM's product is not rounded to bf16
(apex's fused accumulation, or torch.mm's out_dtype=float32), so dW matches float64 to 1e-5.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.config import ModelConfig
from megapipe.distributed.grad_buffer import SHARD_ALIGNMENT, GradBuffer
from megapipe.kernels.weight_grad_gemm import weight_grad_path
from megapipe.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megapipe.layers.cross_entropy import masked_mean
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model import GPTModel
from megapipe.model.initialization import full_tensor, initialize_parameters
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error
from megapipe.testing.reference_gpt import plain_name, reference_from_megapipe

SEED, MICRO_BATCH, MICRO_BATCHES = 5, 2, 2
CONFIG = ModelConfig(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,  # a multiple of 128: no padding, as the plain reference needs
    seq_length=8,
    ffn_hidden_size=64,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
TOKENS = MICRO_BATCH * CONFIG.seq_length
LINEARS = 5  # QKV, proj, fc1, fc2 and the output layer (tied to the word embedding)
TOLERANCE = 3e-2

_aten = torch.ops.aten
GEMMS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}


class GemmRecorder(TorchDispatchMode):
    """Records (op, operand dtypes, operand shapes) of every GEMM dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[tuple[str, tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in GEMMS or packet in (_aten.addmm_, _aten.baddbmm_):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if packet in (_aten.addmm, _aten.addmm_, _aten.baddbmm, _aten.baddbmm_):
                operands = operands[1:]  # the addend is no GEMM operand
            self.gemms.append(
                (
                    str(func),
                    tuple(a.dtype for a in operands),
                    tuple(tuple(a.shape) for a in operands),
                )
            )
        return func(*args, **(kwargs or {}))


def weight_grad_gemms(recorder: GemmRecorder, weight_shapes: set[tuple[int, int]]) -> list:
    """The recorded GEMMs [m, TOKENS] @ [TOKENS, n] whose [m, n] is a linear weight's shape."""
    return [
        (op, dtypes)
        for op, dtypes, shapes in recorder.gemms
        if len(shapes) == 2
        and len(shapes[0]) == 2
        and shapes[0][1] == TOKENS
        and (shapes[0][0], shapes[1][-1]) in weight_shapes
    ]


def _batch(microbatch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + microbatch)
    return torch.randint(0, CONFIG.vocab_size, (MICRO_BATCH, CONFIG.seq_length + 1), generator=g)


def _mean_loss(per_token: torch.Tensor) -> torch.Tensor:
    return masked_mean(per_token.float(), torch.ones(per_token.shape)) / MICRO_BATCHES


def _bf16_step(deferred: bool):
    """One bf16 step of two micro-batches; returns the GEMMs, main_grads and fp32 reference."""
    state = ParallelState.single()
    model = GPTModel(CONFIG, state, RNGTracker(SEED, tp_rank=0), seed=SEED)
    reference = reference_from_megapipe(model)  # fp32 copies of the initial weights
    model.to(torch.bfloat16)
    store = WeightGradStore().attach(model)
    buffer = GradBuffer(list(model.parameters()), state.dp, num_microbatches=MICRO_BATCHES)
    recorder = GemmRecorder()
    with recorder:
        for microbatch in range(MICRO_BATCHES):
            tokens = _batch(microbatch)
            loss = _mean_loss(model(tokens=tokens[:, :-1], labels=tokens[:, 1:]))
            with store.deferring() if deferred else contextlib.nullcontext():
                loss.backward()
        if deferred:
            assert store.compute_weight_grads() == MICRO_BATCHES
    buffer.finish_grad_sync()
    for microbatch in range(MICRO_BATCHES):
        tokens = _batch(microbatch)
        _mean_loss(reference(tokens[:, :-1], tokens[:, 1:])).backward()
    plain = dict(reference.named_parameters())
    errors = {
        name: relative_error(p.main_grad, plain[plain_name(name)].grad)
        for name, p in model.named_parameters()
    }
    linears = (ColumnParallelLinear, RowParallelLinear)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, linears)}
    assert len(shapes) == LINEARS  # all five differ: a GEMM's output shape names its weight
    return recorder, weight_grad_gemms(recorder, shapes), errors, buffer.grad_data.clone()


@pytest.fixture(scope="module")
def immediate():
    return _bf16_step(deferred=False)


def test_no_weight_gradient_gemm_of_a_bf16_step_runs_in_fp32(immediate):
    recorder, weight_grads, _, _ = immediate
    assert weight_grad_path(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16),
                            torch.zeros(1, dtype=torch.bfloat16)) == "half_mm"  # fmt: skip
    assert len(weight_grads) == LINEARS * MICRO_BATCHES, weight_grads
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for _, dtypes in weight_grads)
    fp32 = [g for g in recorder.gemms if torch.float32 in g[1]]
    assert fp32 == []  # no GEMM of the step at all runs in fp32


def test_bf16_main_grads_are_within_bf16_tolerance_of_the_fp32_reference(immediate):
    _, _, errors, _ = immediate
    assert len(errors) == 16  # the layer's 12, both embeddings and the final norm's 2
    assert max(errors.values()) < TOLERANCE, errors
    assert max(errors.values()) > 1e-4, errors  # the step did compute in bf16


def test_deferred_bf16_weight_gradients_are_bf16_gemms_and_the_same_bits(immediate):
    *_, grad_data = immediate
    recorder, weight_grads, errors, deferred_grad_data = _bf16_step(deferred=True)
    assert len(weight_grads) == LINEARS * MICRO_BATCHES
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for _, dtypes in weight_grads)
    assert not any(torch.float32 in g[1] for g in recorder.gemms)
    assert torch.equal(deferred_grad_data, grad_data)


def _repeated_token(rank: int, world: int):
    """bf16 embedding, two tokens 256 times each in each of 4 micro-batches, vs fp64."""
    tp = ParallelState.build(tensor_model_parallel_size=world).tp
    vocab, hidden, microbatches = 16, 8, 4

    def layer() -> VocabParallelEmbedding:
        embedding = VocabParallelEmbedding(vocab, hidden, tp, init_std=1.0)
        initialize_parameters(embedding, 1, tp.rank, tp.size)
        return embedding.to(torch.bfloat16)

    buffered, plain = layer(), layer()
    buffer = GradBuffer([buffered.weight], Group.single(), num_microbatches=microbatches)
    exact = torch.zeros(vocab, hidden, dtype=torch.float64)
    ids = torch.full((512, 1), 3)
    ids[1::2] = 11  # at TP=2 one token on each rank
    for microbatch in range(microbatches):
        g = torch.Generator().manual_seed(microbatch)
        c = (1.0 + torch.rand(512, 1, hidden, generator=g)).to(torch.bfloat16)
        (buffered(ids) * c).sum().backward()
        (plain(ids) * c).sum().backward()
        table = full_tensor(1, "weight", buffered.weight.meta).double().requires_grad_()
        (torch.nn.functional.embedding(ids, table) * c.double()).sum().backward()
        exact += table.grad
    buffer.finish_grad_sync()
    lo, hi = buffered.start, buffered.end
    return (
        buffered.weight.main_grad.dtype,
        relative_error(buffered.weight.main_grad, exact[lo:hi]),
        relative_error(plain.weight.grad, exact[lo:hi]),  # autograd's path: a bf16 table
    )


@pytest.mark.parametrize("world", [1, 2])
def test_embedding_gradient_is_summed_in_fp32_main_grad(world):
    for dtype, buffered, bf16_table in run_distributed(_repeated_token, world):
        assert dtype == torch.float32
        assert buffered < 1e-6, buffered
        assert bf16_table > 1e-3, bf16_table  # what summing in the weight's dtype loses


@pytest.mark.parametrize("dp", [2, 3, 4, 6, 8, 12])
def test_every_shard_of_every_bucket_starts_aligned_for_any_dp_size(dp):
    sizes = (5, 1000, 77, 4096, 129, 3, 640)
    starts: list[list[int]] = []
    for rank in range(dp):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        buffer = GradBuffer(
            params, Group(tuple(range(dp)), rank), num_microbatches=1, bucket_size=700,
            shard=True, solo=[params[1]],
        )  # fmt: skip
        ranges = buffer.shard_ranges()
        assert len(ranges) == len(buffer.buckets) >= 4
        for (lo, hi), bucket in zip(ranges, buffer.buckets):
            assert lo % SHARD_ALIGNMENT == 0 and (hi - lo) % SHARD_ALIGNMENT == 0
            assert (bucket.end - bucket.start) == dp * (hi - lo)  # equal shards tile the bucket
        assert buffer.numel % (dp * SHARD_ALIGNMENT) == 0
        assert buffer.numel < sum(sizes) + len(buffer.buckets) * dp * SHARD_ALIGNMENT
        starts.append([lo for lo, _ in ranges])
    for bucket_starts in zip(*starts):  # the ranks' shards are disjoint and in rank order
        assert list(bucket_starts) == sorted(set(bucket_starts))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused paths need CUDA")
def test_cuda_weight_gradient_gemm_runs_in_bf16_and_sums_in_fp32():
    """On CUDA the product is not rounded to bf16 (apex or mm.dtype: fp32 output), so two
    micro-batches' dW is the float64 value to fp32 rounding; and the GEMM's operands are bf16."""
    from megapipe.kernels.weight_grad_gemm import accumulate_weight_grad

    g = torch.Generator().manual_seed(0)
    factors = [(torch.randn(512, 96, generator=g), torch.randn(512, 64, generator=g))] * 2
    main = torch.zeros(96, 64, device="cuda")
    exact = torch.zeros(96, 64, dtype=torch.float64)
    recorder = GemmRecorder()
    for grad_output, inputs in factors:
        dy, x = grad_output.to("cuda", torch.bfloat16), inputs.to("cuda", torch.bfloat16)
        assert weight_grad_path(main, dy, x) in ("apex", "mm_out_dtype")
        with recorder:
            accumulate_weight_grad(main, dy, x)
        exact += dy.double().cpu().t() @ x.double().cpu()
    assert relative_error(main.cpu(), exact) < 1e-5
    assert not any(torch.float32 in dtypes for _, dtypes, _ in recorder.gemms)
