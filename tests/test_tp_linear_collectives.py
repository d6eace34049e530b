"""How many collectives one transformer layer issues, counted at torch.distributed itself.

The count is real: each rank replaces torch.distributed's collective functions by counting
wrappers (in that forked rank only) and runs a forward and a backward of a 1-layer and a 2-layer
GPT; the difference is what one layer costs (embedding, output layer and loss cancel out).

Measured before the TP linear owned its backward (commit 2e72935), per layer, TP=2:
without SP, forward 2 all-reduces, backward 2 all-reduces; with SP, forward 2 all-gathers +
2 reduce-scatters, backward 2 all-gathers + 2 reduce-scatters. The TP linear keeps the first
unchanged. Under SP it saves the local sequence shard of each column-parallel input instead of
the gathered sequence and gathers it again in backward: one more all-gather per
column-parallel linear (2 per layer), the price of the t-fold smaller saved input, as in
Megatron-LM. Deferring the weight gradients moves that all-gather out of backward into
`compute_weight_grads`, adding none.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.layers.cross_entropy import masked_mean
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
}


class CollectiveCounter:
    """Counts calls of torch.distributed's collectives by kind, under the current `phase`."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.phase = "forward"
        for name, kind in KINDS.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(original, kind))

    def _counting(self, original, kind):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.counts[(self.phase, kind)] += 1
            return original(*args, **kwargs)

        return wrapper


def _config(num_layers: int) -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=8,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def _count(num_layers: int, sequence_parallel: bool, deferred: bool, counter: CollectiveCounter):
    state = ParallelState.build(tensor_model_parallel_size=2)
    config = _config(num_layers)
    model = GPTModel(
        config, state, RNGTracker(5, tp_rank=state.tp_rank), seed=5,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    store = WeightGradStore().attach(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=g)
    counter.counts.clear()
    counter.phase = "forward"
    loss = masked_mean(model(tokens=tokens[:, :-1], labels=tokens[:, 1:]), torch.ones(2, 8))
    counter.phase = "backward"
    if deferred:
        with store.deferring():
            loss.backward()
        counter.phase = "weight"
        store.compute_weight_grads()
    else:
        loss.backward()
    return dict(counter.counts)


def _per_layer(rank, world, sequence_parallel, deferred):
    counter = CollectiveCounter()
    one = _count(1, sequence_parallel, deferred, counter)
    two = _count(2, sequence_parallel, deferred, counter)
    return {
        k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two) if two.get(k) != one.get(k)
    }


BEFORE = {  # measured at commit 2e72935, before the TP linear owned its backward
    False: {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2},
    True: {
        ("forward", "all_gather"): 2,
        ("forward", "reduce_scatter"): 2,
        ("backward", "all_gather"): 2,
        ("backward", "reduce_scatter"): 2,
    },
}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_collectives_per_layer(sequence_parallel):
    per_layer = run_distributed(_per_layer, 2, sequence_parallel, False)
    assert per_layer[0] == per_layer[1]
    expected = dict(BEFORE[sequence_parallel])
    if sequence_parallel:  # the column-parallel inputs are gathered again in backward
        expected[("backward", "all_gather")] += 2
    assert per_layer[0] == expected


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_deferred_weight_gradients_add_no_collective(sequence_parallel):
    immediate = run_distributed(_per_layer, 2, sequence_parallel, False)[0]
    deferred = run_distributed(_per_layer, 2, sequence_parallel, True)[0]
    moved = {k: v for k, v in deferred.items() if k[0] == "weight"}
    if sequence_parallel:  # the re-gather of each column-parallel input moves to the W step
        assert moved == {("weight", "all_gather"): 2}
    else:
        assert moved == {}
    assert _by_kind(deferred) == _by_kind(immediate)


def _by_kind(counts):
    total = collections.Counter()
    for (_, kind), n in counts.items():
        total[kind] += n
    return total
