"""--context-parallel-size and --cp-comm-type: parsed into ParallelConfig, validated, and
their comm type handed to the layers.
The refusals' exact lines are rows of tests/test_bad_input.py's catalogue."""

import warnings

import pytest

from megapipe.arguments import parse_args
from megapipe.config import ParallelConfig
from megapipe.errors import ConfigError
from megapipe.training.log_format import world_size_line
from tests.helpers import argv


def _parse(world_size: int, extra: list[str] = (), **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_args(argv(**flags) + list(extra), world_size)


def test_defaults_are_megatrons_and_cp_one_changes_nothing():
    configs = _parse(4, tensor_model_parallel_size=2)
    assert configs.parallel.context_parallel_size == 1
    assert configs.parallel.cp_comm_type == "p2p"
    assert configs.data_parallel_size == 2
    explicit = _parse(4, tensor_model_parallel_size=2, context_parallel_size=1)
    assert explicit.parallel == configs.parallel


@pytest.mark.parametrize("kind", ["p2p", "all_gather", "a2a"])
def test_each_comm_type_is_accepted_at_cp_one(kind):
    assert _parse(1, cp_comm_type=kind).parallel.cp_comm_type == kind


def test_data_parallel_size_counts_context_parallel_ranks():
    parallel = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2)
    assert parallel.data_parallel_size(16) == 4
    assert parallel.model_parallel_size == 2  # Megatron's model-parallel group: TP x PP


def test_cp_above_one_is_accepted_and_reaches_the_layers():
    # 8 ranks of TP 2 x CP 2 (DP 2), a2a with 4 heads; the layers read the comm type from
    # the kernel config (tests/test_parity_context_parallel.py trains it)
    configs = _parse(
        8,
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        cp_comm_type="a2a",
        global_batch_size=8,
        attention_dropout=0,
    )
    assert configs.parallel.context_parallel_size == 2
    assert configs.parallel.cp_comm_type == configs.kernels.cp_comm_type == "a2a"
    assert configs.data_parallel_size == 2


def test_global_batch_is_checked_against_dp_without_cp():
    # 8 ranks = CP 4 x DP 2: the global batch must be a multiple of micro-batch 2 x DP 2
    with pytest.raises(ConfigError, match=r"data-parallel size \(2\) = 4"):
        _parse(8, context_parallel_size=4, global_batch_size=6)


def test_world_size_line_names_cp_only_above_one():
    assert (
        world_size_line(8, 2, 2, 1)
        == world_size_line(8, 2, 2, 1, 1)
        == (
            "using world size: 8, data-parallel size: 2, tensor-model-parallel size: 2, "
            "pipeline-model-parallel size: 1"
        )
    )
    assert world_size_line(8, 2, 2, 1, 2) == (
        "using world size: 8, data-parallel size: 2, context-parallel size: 2, "
        "tensor-model-parallel size: 2, pipeline-model-parallel size: 1"
    )
