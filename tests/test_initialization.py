"""Layout-invariant initialisation and Megatron's init scheme."""

import math

import torch

from megapipe.config import ModelConfig
from megapipe.model import GPTModel
from megapipe.model.initialization import name_seed
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState

CONFIG = ModelConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=200, seq_length=8
)


def build(layers=None, seed=1, config=CONFIG):
    return GPTModel(config, ParallelState.single(), RNGTracker(seed), seed=seed, layers=layers)


def test_a_pipeline_stage_holds_the_full_models_values_under_the_same_names():
    full = dict(build().named_parameters())
    first, middle, last = build(range(0, 1)), build(range(1, 3)), build(range(3, 4))
    assert first.embedding is not None and first.output_layer is None
    assert middle.embedding is None and middle.output_layer is None
    assert last.embedding is None and last.output_layer is not None
    for stage in (first, middle, last):
        for name, param in stage.named_parameters():
            if name == "output_layer.weight":  # the last stage's copy of the tied embedding
                assert param.meta.copy_of == "embedding.word_embeddings.weight"
                assert torch.equal(param, full["embedding.word_embeddings.weight"])
            else:
                assert torch.equal(param, full[name]), name
    assert {n for s in (first, middle, last) for n, _ in s.named_parameters()} - {
        "output_layer.weight"
    } == set(full)


def test_seed_changes_every_random_tensor_and_names_do_not_collide():
    a, b = dict(build(seed=1).named_parameters()), dict(build(seed=2).named_parameters())
    for name, param in a.items():
        if param.meta.init_std is not None:
            assert not torch.equal(param, b[name]), name
    seeds = {name_seed(1, name) for name in a}
    assert len(seeds) == len(a)


def test_megatron_init_scheme():
    config = ModelConfig(
        num_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=1000,
        seq_length=8,
        init_method_std=0.02,
    )
    params = dict(build(config=config).named_parameters())
    scaled = 0.02 / math.sqrt(2 * 8)
    for name, p in params.items():
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert abs(p.std().item() - scaled) < 0.05 * scaled, name
        elif name.endswith(
            (
                "linear_qkv.weight",
                "linear_fc1.weight",
                "word_embeddings.weight",
                "position_embeddings.weight",
            )
        ):
            assert abs(p.std().item() - 0.02) < 0.05 * 0.02, name
        elif name.endswith("layernorm.weight"):
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            raise AssertionError(f"unexpected parameter {name}")


def test_vocabulary_rows_do_not_depend_on_padding():
    few = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=200,
        seq_length=8,
        make_vocab_size_divisible_by=8,
    )
    many = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=200,
        seq_length=8,
        make_vocab_size_divisible_by=128,
    )
    a = build(config=few).embedding.word_embeddings.weight
    b = build(config=many).embedding.word_embeddings.weight
    assert a.shape[0] == 200 and b.shape[0] == 256
    assert torch.equal(a, b[:200])
