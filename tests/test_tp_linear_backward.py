"""The TP linear's own backward: what it saves, its gradients under SP, fused accumulation.

Saved bytes are counted with torch.autograd.graph.saved_tensors_hooks (parameters excluded):
deterministic, not allocator noise. The "before" number is measured on the path the layer took
until it owned its backward, rebuilt here from the mappings that still exist
(gather_from_sequence_parallel_region, then F.linear), so the comparison is measured too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.layers import ColumnParallelLinear, VocabParallelEmbedding
from megapipe.layers.linear import set_tp_comm_overlap
from megapipe.layers.param_meta import shard_of
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model.initialization import full_tensor, initialize_parameters
from megapipe.parallel.mappings import gather_from_sequence_parallel_region
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error

S, B, H, OUT = 16, 2, 64, 96  # [sequence, batch, hidden], output features


def _randn(seed, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def saved_bytes(forward, params) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while forward() runs."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def _column(tp, sequence_parallel, **kwargs):
    layer = ColumnParallelLinear(
        H, OUT, tp, init_std=0.5, sequence_parallel=sequence_parallel, **kwargs
    )
    initialize_parameters(layer, 3, tp.rank, tp.size)
    with torch.no_grad():
        layer.bias.copy_(shard_of(_randn(4, OUT), layer.bias.meta, tp.rank, tp.size))
    return layer


def _saved(rank, world, sequence_parallel):
    tp = ParallelState.build(tensor_model_parallel_size=world).tp
    layer = _column(tp, sequence_parallel)
    local = S // world if sequence_parallel else S
    x = _randn(rank, local, B, H).requires_grad_()
    now = saved_bytes(lambda: layer(x), layer.parameters())
    if sequence_parallel:  # the path before: gather in a mapping, then F.linear saves its input
        before = saved_bytes(
            lambda: F.linear(gather_from_sequence_parallel_region(x, tp), layer.weight, layer.bias),
            layer.parameters(),
        )
    else:
        before = saved_bytes(lambda: F.linear(x, layer.weight, layer.bias), layer.parameters())
    return now, before


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear_saves_only_the_local_sequence_shard(sequence_parallel):
    for now, before in run_distributed(_saved, 2, sequence_parallel):
        full = S * B * H * 4  # fp32 [s, b, h]
        assert before == full  # measured on the old path: the gathered sequence
        assert now == (full // 2 if sequence_parallel else full)


def _sp_gradients(rank, world, with_buffer, deferred):
    """Column-parallel under SP against unsharded torch; grads from autograd or main_grad."""
    tp = ParallelState.build(tensor_model_parallel_size=world).tp
    layer = _column(tp, True)
    weight_ref = full_tensor(3, "weight", layer.weight.meta)
    bias_ref = _randn(4, OUT)
    buffer = None
    if with_buffer:
        buffer = GradBuffer(list(layer.parameters()), ParallelState.single().dp, num_microbatches=1)
    store = WeightGradStore().attach(layer)
    x_ref = _randn(7, S, B, H).requires_grad_()
    c = _randn(9, S, B, OUT)
    (F.linear(x_ref, weight_ref, bias_ref) * c).sum().backward()

    x = x_ref.detach().chunk(world)[rank].clone().requires_grad_()
    y, _ = layer(x)
    c_local = c.chunk(world, dim=-1)[rank]
    with store.deferring() if deferred else contextlib.nullcontext():
        (y * c_local).sum().backward()
    if deferred:
        assert layer.weight.grad is None and store.compute_weight_grads() == 1
    if buffer is not None:  # claimed parameters never got an autograd gradient
        assert layer.weight.grad is None and layer.bias.grad is None
        buffer.finish_grad_sync()
    grad_of = (lambda p: p.main_grad) if with_buffer else (lambda p: p.grad)
    weight_grad_ref = c.reshape(-1, OUT).t() @ x_ref.detach().reshape(-1, H)
    return [
        relative_error(x.grad, x_ref.grad.chunk(world)[rank]),
        relative_error(
            grad_of(layer.weight), shard_of(weight_grad_ref, layer.weight.meta, rank, world)
        ),
        relative_error(grad_of(layer.bias), c_local.sum((0, 1))),
    ]


@pytest.mark.parametrize("with_buffer", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_sequence_parallel_column_linear_matches_unsharded_torch(with_buffer, deferred):
    for errors in run_distributed(_sp_gradients, 2, with_buffer, deferred):
        assert max(errors) < 1e-5, errors


def test_half_precision_weight_gradients_are_summed_in_fp32():
    """bf16 weights, fp32 main_grad: each micro-batch's dW is a bf16 GEMM (on CPU its product is
    rounded to bf16 once: kernels/weight_grad_gemm.py's "half_mm"), and the micro-batches are
    summed in fp32 in main_grad: K equal micro-batches give exactly K x the one-micro-batch
    product, where autograd's bf16 .grad, summing in bf16, drifts away from it."""
    tp = ParallelState.single().tp
    layer = _column(tp, False).to(torch.bfloat16)
    microbatches = 24
    buffer = GradBuffer(
        list(layer.parameters()), ParallelState.single().dp, num_microbatches=microbatches
    )
    x = _randn(10, S, B, H).to(torch.bfloat16)
    c = _randn(20, S, B, OUT).to(torch.bfloat16)
    for _ in range(microbatches):
        (layer(x)[0] * c).sum().backward()
    buffer.finish_grad_sync()
    assert layer.weight.main_grad.dtype == torch.float32 and layer.weight.grad is None
    plain = _column(tp, False).to(torch.bfloat16)  # no buffer: a bf16 .grad, as autograd's
    (plain(x)[0] * c).sum().backward()
    once = plain.weight.grad
    assert once.dtype == torch.bfloat16
    exact = c.double().reshape(-1, OUT).t() @ x.double().reshape(-1, H)
    assert relative_error(once, exact) < 2**-8  # one bf16 rounding of the product
    assert torch.equal(layer.weight.main_grad, microbatches * once.float())
    for _ in range(microbatches - 1):
        (plain(x)[0] * c).sum().backward()
    assert relative_error(plain.weight.grad, microbatches * once.double()) > 1e-3


def _embedding(rank, world):
    tp = ParallelState.build(tensor_model_parallel_size=world).tp
    layer = VocabParallelEmbedding(64, 8, tp, init_std=1.0, vocab_size=60)
    initialize_parameters(layer, 11, tp.rank, tp.size)
    table = full_tensor(11, "weight", layer.weight.meta).requires_grad_()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))  # repeats
    c = _randn(3, 4, 16, 8)
    (F.embedding(ids, table) * c).sum().backward()
    (layer(ids) * c).sum().backward()
    rows = table.grad.chunk(world)[rank]
    return torch.equal(layer.weight.grad, rows)


@pytest.mark.parametrize("world", [1, 2])
def test_embedding_weight_gradient_is_bit_identical_to_autograds(world):
    assert all(run_distributed(_embedding, world))


def _gradients_with_overlap(rank, world, sequence_parallel, overlap):
    tp = ParallelState.build(tensor_model_parallel_size=world).tp
    layer = _column(tp, sequence_parallel)
    set_tp_comm_overlap(layer, overlap)
    x_full = _randn(7, S, B, H)
    x = (x_full.chunk(world)[rank] if sequence_parallel else x_full).clone().requires_grad_()
    y, _ = layer(x)
    (y * _randn(9 + rank, *y.shape)).sum().backward()
    return [x.grad, layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_waiting_at_once_instead_of_overlapping_changes_no_gradient(sequence_parallel):
    """--no-async-tensor-model-parallel-allreduce only moves the waits: same bits."""
    on = run_distributed(_gradients_with_overlap, 2, sequence_parallel, True)
    off = run_distributed(_gradients_with_overlap, 2, sequence_parallel, False)
    for rank_on, rank_off in zip(on, off):
        for a, b in zip(rank_on, rank_off):
            assert torch.equal(a, b)
