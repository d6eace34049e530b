"""Each autograd collective against the unsharded math, forward and backward.

Convention: every rank computes a local loss sum(output * c_rank). For outputs that are
replicated across the group (Megatron's convention) the model's loss is any one rank's loss, so
all ranks use the same c; for outputs that differ per rank the model's loss is the sum of the
local losses. The expected input gradient follows from the unsharded math written out here.
"""

import pytest
import torch

from megapipe.parallel import mappings as m
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed

SHAPE = (8, 3, 12)  # [sequence, batch, hidden]; both split dims divide by 2 and 4


def _tensor(seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(rank, world, name):
    state = ParallelState.build(tensor_model_parallel_size=world)
    group = state.tp
    r, t = group.rank, group.size
    x_of = [_tensor(100 + j) for j in range(t)]  # per-rank inputs, known to every rank
    c_of = [_tensor(200 + j) for j in range(t)]  # per-rank loss weights
    shared_x, shared_c = _tensor(300), _tensor(400)

    def chunks(x, dim):
        return list(x.chunk(t, dim))

    if name == "copy_to_tp_region":  # identity; every rank's partial loss flows back to x
        x = shared_x.clone().requires_grad_()
        y = m.copy_to_tp_region(x, group)
        expect_y, expect_grad, c = shared_x, sum(c_of), c_of[r]
    elif name == "reduce_from_tp_region":  # sum of partials; replicated output
        x = x_of[r].clone().requires_grad_()
        y = m.reduce_from_tp_region(x, group)
        expect_y, expect_grad, c = sum(x_of), shared_c, shared_c
    elif name == "scatter_to_tp_region":
        x = shared_x.clone().requires_grad_()
        y = m.scatter_to_tp_region(x, group)
        c_local = chunks(c_of[r], -1)[r]
        expect_y = chunks(shared_x, -1)[r]
        expect_grad = torch.cat([chunks(c_of[j], -1)[j] for j in range(t)], -1)
        c = c_local
    elif name == "gather_from_tp_region":  # replicated output
        x = chunks(shared_x, -1)[r].clone().requires_grad_()
        y = m.gather_from_tp_region(x, group)
        expect_y, expect_grad, c = shared_x, chunks(shared_c, -1)[r], shared_c
    elif name == "scatter_to_sequence_parallel_region":
        x = shared_x.clone().requires_grad_()
        y = m.scatter_to_sequence_parallel_region(x, group)
        expect_y = chunks(shared_x, 0)[r]
        expect_grad = torch.cat([chunks(c_of[j], 0)[j] for j in range(t)], 0)
        c = chunks(c_of[r], 0)[r]
    elif name == "gather_from_sequence_parallel_region":  # consumers in a TP region: partial
        x = chunks(shared_x, 0)[r].clone().requires_grad_()
        y = m.gather_from_sequence_parallel_region(x, group)
        expect_y, expect_grad, c = shared_x, chunks(sum(c_of), 0)[r], c_of[r]
    elif name == "gather_from_sequence_parallel_region/replicated":
        x = chunks(shared_x, 0)[r].clone().requires_grad_()
        y = m.gather_from_sequence_parallel_region(x, group, grad_is_partial=False)
        expect_y, expect_grad, c = shared_x, chunks(shared_c, 0)[r], shared_c
    elif name == "reduce_scatter_to_sequence_parallel_region":
        x = x_of[r].clone().requires_grad_()
        y = m.reduce_scatter_to_sequence_parallel_region(x, group)
        expect_y = chunks(sum(x_of), 0)[r]
        expect_grad = torch.cat([chunks(c_of[j], 0)[j] for j in range(t)], 0)
        c = chunks(c_of[r], 0)[r]
    else:
        raise ValueError(name)
    (y * c).sum().backward()
    return (y - expect_y).abs().max().item(), (x.grad - expect_grad).abs().max().item()


MAPPINGS = [
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_sequence_parallel_region/replicated",
    "reduce_scatter_to_sequence_parallel_region",
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MAPPINGS)
def test_mapping_forward_and_backward_match_unsharded_math(name, world):
    for forward_err, backward_err in run_distributed(_run, world, name):
        assert forward_err < 1e-12
        assert backward_err < 1e-12


def test_mappings_are_free_for_a_group_of_one():
    group = ParallelState.single().tp
    x = torch.randn(4, 2, 6)
    for fn in (
        m.copy_to_tp_region,
        m.reduce_from_tp_region,
        m.scatter_to_tp_region,
        m.gather_from_tp_region,
        m.scatter_to_sequence_parallel_region,
        m.gather_from_sequence_parallel_region,
        m.reduce_scatter_to_sequence_parallel_region,
    ):
        assert fn(x, group) is x
