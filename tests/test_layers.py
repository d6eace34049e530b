"""Tensor-parallel layers against their unsharded torch equivalents, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.layers import (
    ColumnParallelLinear,
    ParamMeta,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_of,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model.initialization import full_tensor, initialize_parameters
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error

TOL = 1e-5


def _randn(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _init_with_random_biases(layer, seed, tp):
    """Initialise `layer` from global names, with non-zero biases; return the full tensors."""
    full = {}
    for name, p in layer.named_parameters():
        if p.meta.init_std is None:  # biases start at zero: make them count in the test
            full[name] = _randn(seed + 7, *p.meta.full_shape)
        else:
            full[name] = full_tensor(seed, name, p.meta)
        p.data.copy_(shard_of(full[name], p.meta, tp.rank, tp.size))
    return full


def _last_dim_shard(t, stride, rank, world):
    """The slice of the last dimension a column-parallel layer with `stride` produces."""
    meta = ParamMeta((t.shape[-1],), tp_dim=0, tp_stride=stride)
    return shard_of(t.movedim(-1, 0), meta, rank, world).movedim(0, -1)


def _column(rank, world, gather_output, skip_bias_add, stride):
    tp = ParallelState.build(world).tp
    layer = ColumnParallelLinear(
        12,
        16,
        tp,
        init_std=0.5,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        stride=stride,
    )
    full = _init_with_random_biases(layer, 3, tp)
    x_ref = _randn(1, 5, 2, 12).requires_grad_()
    x = x_ref.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, full["weight"], full["bias"])
    y, bias = layer(x)
    if skip_bias_add:
        assert bias is layer.bias
        y = y + bias
    c = _randn(9, *y_ref.shape)
    if not gather_output:
        y_ref_out, c_out = (_last_dim_shard(t, stride, rank, world) for t in (y_ref, c))
    else:
        y_ref_out, c_out = y_ref, c
    (y_ref * c).sum().backward()
    (y * c_out).sum().backward()
    weight_grad = c.reshape(-1, 16).t() @ x_ref.detach().reshape(-1, 12)
    return [
        relative_error(y, y_ref_out),
        relative_error(x.grad, x_ref.grad),
        relative_error(layer.weight.grad, shard_of(weight_grad, layer.weight.meta, rank, world)),
    ]


@pytest.mark.parametrize(
    "gather_output,skip_bias_add,stride", [(True, False, 1), (False, True, 1), (False, False, 2)]
)
def test_column_parallel_linear(gather_output, skip_bias_add, stride):
    for errors in run_distributed(_column, 2, gather_output, skip_bias_add, stride):
        assert max(errors) < TOL, errors


def _row(rank, world, input_is_parallel, skip_bias_add):
    tp = ParallelState.build(world).tp
    layer = RowParallelLinear(
        16, 12, tp, init_std=0.5, input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add
    )
    full = _init_with_random_biases(layer, 5, tp)
    x_ref = _randn(2, 5, 2, 16).requires_grad_()
    x_in = x_ref.detach().clone()
    if input_is_parallel:
        x_in = x_in.chunk(world, -1)[rank].clone()
    x = x_in.requires_grad_()
    y, bias = layer(x)
    if skip_bias_add:
        assert bias is layer.bias
        y = y + bias
    y_ref = F.linear(x_ref, full["weight"], full["bias"])
    c = _randn(9, *y_ref.shape)
    (y_ref * c).sum().backward()
    (y * c).sum().backward()
    grad_ref = x_ref.grad.chunk(world, -1)[rank] if input_is_parallel else x_ref.grad
    return [
        relative_error(y, y_ref),
        relative_error(x.grad, grad_ref),
        relative_error(
            layer.weight.grad,
            shard_of(
                c.reshape(-1, 12).t() @ x_ref.detach().reshape(-1, 16),
                layer.weight.meta,
                rank,
                world,
            ),
        ),
        relative_error(layer.bias.grad, c.reshape(-1, 12).sum(0)),
    ]


@pytest.mark.parametrize("input_is_parallel,skip_bias_add", [(True, False), (False, True)])
def test_row_parallel_linear(input_is_parallel, skip_bias_add):
    for errors in run_distributed(_row, 2, input_is_parallel, skip_bias_add):
        assert max(errors) < TOL, errors


def _embedding(rank, world):
    tp = ParallelState.build(world).tp
    layer = VocabParallelEmbedding(64, 8, tp, init_std=1.0, vocab_size=60)
    initialize_parameters(layer, 11, tp.rank, tp.size)
    reference = VocabParallelEmbedding(
        64, 8, ParallelState.single().tp, init_std=1.0, vocab_size=60
    )
    initialize_parameters(reference, 11, 0, 1)
    ids = torch.tensor([[0, 15, 16, 31], [32, 47, 48, 63]])  # every rank's first and last row
    c = _randn(3, 2, 4, 8)
    (layer(ids) * c).sum().backward()
    (reference(ids) * c).sum().backward()
    with torch.no_grad():
        out, ref_out = layer(ids), reference(ids)
    return (
        relative_error(out, ref_out),
        relative_error(
            layer.weight.grad, shard_of(reference.weight.grad, layer.weight.meta, rank, world)
        ),
    )


def test_vocab_parallel_embedding_covers_every_rank_range():
    assert [vocab_range(64, r, 4) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    for errors in run_distributed(_embedding, 4):
        assert max(errors) < TOL, errors


def _cross_entropy(rank, world, scale):
    tp = ParallelState.build(world).tp
    logits_ref = (_randn(4, 6, 3, 32) * scale).requires_grad_()
    target = torch.randint(0, 32, (6, 3), generator=torch.Generator().manual_seed(5))
    mask = (torch.arange(18).reshape(6, 3) % 4 != 0).float()
    start, end = vocab_range(32, rank, world)
    logits = logits_ref.detach()[..., start:end].clone().requires_grad_()

    loss = masked_mean(vocab_parallel_cross_entropy(logits, target, tp, start), mask)
    ref = (
        F.cross_entropy(logits_ref.reshape(-1, 32), target.reshape(-1), reduction="none").reshape(
            6, 3
        )
        * mask
    ).sum() / mask.sum()
    loss.backward()
    ref.backward()
    return (
        relative_error(loss, ref),
        relative_error(logits.grad, logits_ref.grad[..., start:end]),
        bool(torch.isfinite(loss)),
    )


@pytest.mark.parametrize("scale", [1.0, 1e4])  # large logits: the max-shift keeps it finite
def test_vocab_parallel_cross_entropy_matches_torch_with_a_loss_mask(scale):
    for loss_err, grad_err, finite in run_distributed(_cross_entropy, 4, scale):
        assert finite
        assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


def test_vocabulary_padding_follows_megatron():
    def config(vocab, divisible_by=128):
        return ModelConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=1,
            vocab_size=vocab,
            seq_length=4,
            make_vocab_size_divisible_by=divisible_by,
        )

    assert config(50257).padded_vocab_size(1) == 50304
    assert config(50257).padded_vocab_size(2) == 50432
    assert config(50257).padded_vocab_size(8) == 51200
    assert config(512).padded_vocab_size(4) == 512
    assert config(100, divisible_by=1).padded_vocab_size(1) == 100


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_one_rank_cross_entropy_matches_torch_loss_and_gradient_with_padding(scale):
    """One TP rank: the in-place backward against F.cross_entropy (the padding ids sliced off
    get a zero gradient), and a second backward over the same graph refused by name."""
    torch.manual_seed(3)
    logits = (torch.randn(5, 3, 40) * scale).requires_grad_()
    target = torch.randint(0, 37, (5, 3))
    weight = torch.rand(5, 3)
    group = ParallelState.single().tp
    loss = vocab_parallel_cross_entropy(logits, target, group, 0, vocab_size=37)
    (loss * weight).sum().backward(retain_graph=True)
    ref_logits = logits.detach().clone().requires_grad_()
    flat = ref_logits[..., :37].reshape(-1, 37)
    ref = F.cross_entropy(flat, target.reshape(-1), reduction="none")
    (ref.view(5, 3) * weight).sum().backward()
    assert torch.isfinite(loss).all()
    assert relative_error(loss, ref.view(5, 3)) < TOL
    assert relative_error(logits.grad, ref_logits.grad) < TOL
    assert torch.equal(logits.grad[..., 37:], torch.zeros(5, 3, 3))
    with pytest.raises(RuntimeError, match="backward ran twice"):
        (loss * weight).sum().backward()
