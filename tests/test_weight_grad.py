"""Weight gradients delivered by their layers: into the grad buffer, deferred, never lost.

A GPT at TP2 x DP2 (with and without SP, tied embeddings on one stage, so the word embedding
has two claiming layers: the lookup and the output layer) accumulates two micro-batches into a
GradBuffer with overlapped, bucketed reduction. Deferred weight gradients, computed after both
backward passes and before the grad sync, must give bit-identical main_grads, and the buckets
must then start during `compute_weight_grads` instead of backward.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.layers.cross_entropy import masked_mean
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error

SEED = 7
TIED = "embedding.word_embeddings.weight"
CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=8,
    ffn_hidden_size=64,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _model(state: ParallelState, sequence_parallel: bool) -> GPTModel:
    rng = RNGTracker(SEED, tp_rank=state.tp_rank)
    return GPTModel(CONFIG, state, rng, seed=SEED, sequence_parallel=sequence_parallel)


def _loss(model: GPTModel, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=g)
    per_token = model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    return masked_mean(per_token, torch.ones(2, CONFIG.seq_length)) / 2


def _two_microbatches(rank, world, sequence_parallel, deferred, with_buffer):
    state = ParallelState.build(tensor_model_parallel_size=2)
    model = _model(state, sequence_parallel)
    store = WeightGradStore().attach(model)
    buffer = None
    if with_buffer:
        buffer = GradBuffer(
            list(model.parameters()),
            state.dp,
            num_microbatches=2,
            bucket_size=3000,
            overlap=True,
            solo=[model.shared_word_embedding()],
        )
    for microbatch in range(2):
        loss = _loss(model, 100 * state.dp_rank + microbatch)
        with store.deferring() if deferred else contextlib.nullcontext():
            loss.backward()
    if buffer is None:
        if deferred:
            assert all(p.grad is None for p in model.output_layer.parameters())
            assert store.compute_weight_grads() == 2
        return {n: p.grad.clone() for n, p in model.named_parameters()}, None
    in_backward = buffer.started_before_finish
    if deferred:
        assert store.pending_units == 2
        assert store.compute_weight_grads() == 2
    started = (in_backward, buffer.started_before_finish, len(buffer.buckets))
    buffer.finish_grad_sync()
    assert all(p.grad is None for p in model.parameters())
    return {"buffer": buffer.grad_data.clone()}, started


@pytest.mark.parametrize("with_buffer", [True, False])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_deferred_weight_gradients_are_bit_identical(sequence_parallel, with_buffer):
    immediate = run_distributed(_two_microbatches, 4, sequence_parallel, False, with_buffer)
    deferred = run_distributed(_two_microbatches, 4, sequence_parallel, True, with_buffer)
    for (grads, started), (deferred_grads, deferred_started) in zip(immediate, deferred):
        for name, grad in grads.items():
            if name == TIED and not with_buffer:
                # Without a buffer autograd sums the lookup's and the output layer's parts of a
                # micro-batch before adding them to .grad; deferred, each is added in turn.
                assert relative_error(deferred_grads[name], grad) < 1e-6, name
            else:
                assert torch.equal(grad, deferred_grads[name]), name
        if with_buffer:
            in_backward, before_finish, buckets = started
            assert buckets >= 3 and in_backward == before_finish == buckets
            in_backward, before_finish, buckets = deferred_started
            # only buckets of autograd's parameters (norms, biases) could start in backward;
            # the rest started when their deferred gradients arrived, still before the sync
            assert in_backward < buckets and before_finish == buckets


def test_main_grads_match_a_plain_model():
    """The buffer's main_grads (two claiming layers on the tied embedding) equal autograd's."""
    state = ParallelState.single()
    plain, buffered = _model(state, False), _model(state, False)
    buffer = GradBuffer(list(buffered.parameters()), state.dp, num_microbatches=2, overlap=True)
    for microbatch in range(2):
        _loss(plain, microbatch).backward()
        _loss(buffered, microbatch).backward()
    buffer.finish_grad_sync()
    for (name, p), q in zip(plain.named_parameters(), buffered.parameters()):
        assert torch.allclose(q.main_grad, p.grad, rtol=1e-5, atol=1e-7), name


def test_a_reduction_while_weight_gradients_are_queued_is_refused():
    state = ParallelState.single()
    model = _model(state, False)
    store = WeightGradStore().attach(model)
    buffer = GradBuffer(list(model.parameters()), state.dp, num_microbatches=1)
    with store.deferring():
        _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="still queued"):
        buffer.finish_grad_sync()
    store.compute_weight_grads()
    buffer.finish_grad_sync()
    with pytest.raises(RuntimeError, match="after its bucket's reduction started"):
        _loss(model, 1).backward()  # a gradient after the sync, before reset(): refused too


def test_a_claimed_parameter_used_outside_its_layers_is_refused():
    state = ParallelState.single()
    model = _model(state, False)
    GradBuffer(list(model.parameters()), state.dp, num_microbatches=1)
    loss = _loss(model, 0) + model.decoder.layers["0"].mlp.linear_fc1.weight.sum()
    with pytest.raises(RuntimeError, match="used outside the layers that claim it"):
        loss.backward()


def test_a_second_store_on_the_same_layers_is_refused():
    """Two executors built on the same chunks must share their stores: a second attach would
    silently leave the first store's deferring() computing weight gradients in B."""
    model = _model(ParallelState.single(), False)
    store = WeightGradStore().attach(model)
    assert store.attach(model) is store  # attaching the same store again is harmless
    with pytest.raises(ValueError, match="already defer their weight gradients into another"):
        WeightGradStore().attach(model)
    with store.deferring():
        _loss(model, 0).backward()
    assert store.pending_units == 1
    assert model.decoder.layers["0"].mlp.linear_fc1.weight.grad is None  # still deferred
