"""Layer partitioning over pipeline stages: never drops a layer, errors name the numbers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.pipeline.partition import balanced_counts, partition_layers


def config(num_layers, vocab=1000, hidden=64):
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=4,
        vocab_size=vocab,
        seq_length=128,
    )


def test_uniform_split_and_virtual_stage_order():
    stage_map = partition_layers(config(8), 2, 2)
    assert stage_map.layers == ((range(0, 2), range(4, 6)), (range(2, 4), range(6, 8)))
    assert "(1, 1): 6-7 (2 layers)" in stage_map.describe()


def test_a_one_layer_stage_is_named_in_the_singular():
    assert partition_layers(config(2), 2).describe().splitlines()[1:] == [
        "  (0, 0): 0 (1 layer)",
        "  (1, 0): 1 (1 layer)",
    ]


def test_30_layers_over_4_stages_is_an_error_not_28_layers():
    with pytest.raises(ConfigError) as err:
        partition_layers(config(30), 4)
    assert "--num-layers (30)" in str(err.value) and "4 pipeline stages" in str(err.value)


def test_first_and_last_overrides():
    stage_map = partition_layers(config(30), 4, first=6, last=6)
    assert [len(r) for r in stage_map.stage_ranges()] == [6, 9, 9, 6]
    with pytest.raises(ConfigError, match="cannot be combined with virtual"):
        partition_layers(config(8), 2, 2, first=3)


def test_balanced_gives_the_output_layer_stage_fewer_layers():
    big_vocab = config(16, vocab=50000, hidden=256)
    counts = balanced_counts(big_vocab, 4, 1)
    assert sum(counts) == 16 and counts[-1] < counts[0]
    assert balanced_counts(config(16, vocab=8, hidden=256), 4, 1) == [4, 4, 4, 4]


@given(
    layers=st.integers(1, 40),
    p=st.integers(1, 6),
    v=st.integers(1, 3),
    vocab=st.sampled_from([8, 1000, 60000]),
)
def test_balanced_partition_never_drops_or_repeats_a_layer(layers, p, v, vocab):
    if layers < p * v:
        with pytest.raises(ConfigError):
            partition_layers(config(layers, vocab), p, v, method="balanced")
        return
    stage_map = partition_layers(config(layers, vocab), p, v, method="balanced")
    covered = [i for r in stage_map.stage_ranges() for i in r]
    assert covered == list(range(layers))
    assert all(len(r) >= 1 for r in stage_map.stage_ranges())
