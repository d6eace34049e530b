"""Megatron-LM's model-shape flags: --kv-channels, --qk-layernorm, --rotary-percent,
--use-rotary-position-embeddings, --squared-relu, --apply-residual-connection-post-layernorm.

Each is checked against the plain-PyTorch reference (`megapipe.testing.reference_gpt`, written
apart from megapipe's model): the same per-token losses and gradients in fp32, with a control
that the flag changes the model at all. Each flag that changes the model trains at TP=2 (one
combined case with sequence parallelism) with the single rank's losses and grad norms, to 1e-5
relative. Generation with the KV cache gives the full forward's logits and tokens under a
partial rotary and a head size other than hidden/heads; a checkpoint keeps the q/k norms under
Megatron-Core's names; the parameter, activation-memory and FLOP counts follow the flags; the
Hugging Face export writes what Llama can express and refuses the rest in one line.

Measured (CPU, fp32, torch 2.13): losses equal the reference's exactly, gradients to 1.2e-7
at most (absolute; the largest gradient is 0.2-0.4); TP=2 losses and grad norms to 9e-8 to
9.5e-7 relative (the post-layernorm residual the largest).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)

from megapipe.arguments import parse_args
from megapipe.arguments.validation import validate_configs
from megapipe.checkpointing.layout_free import logical_name
from megapipe.config import KernelConfig, ModelConfig, ParallelConfig, TrainingConfig
from megapipe.conversion.convert import _fill, build_rank, read_source, resolve
from megapipe.conversion.hf_export import architecture
from megapipe.errors import ConfigError
from megapipe.inference.generation import generate
from megapipe.inference.loading import load_inference_model
from megapipe.inference.sampling import SamplingOptions
from megapipe.kernels.rotary import rotary_reference
from megapipe.model.activation_memory import layer_activation_bytes, saved_activation_bytes
from megapipe.model.gpt import GPTModel
from megapipe.model.kv_cache import KVCache
from megapipe.model.rotary import RotaryEmbedding
from megapipe.model.te_layers import use_transformer_engine
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.partition import layer_flops_per_token
from megapipe.pipeline.stage_memory import stage_parameters
from megapipe.testing import run_distributed
from megapipe.testing.reference_gpt import plain_name, reference_from_megapipe
from megapipe.training.flops import flops_per_iteration
from tests.helpers import MOCK, NO_DROPOUT, argv, parity_losses_and_norms, run
from tests.helpers import convert_gpt as tool

VOCAB, SEQ = 128, 16  # a multiple of 128: no vocabulary padding for the reference
BASE = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
    attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.2,
)  # fmt: skip
ROPE = {"position_embedding_type": "rope"}
# name: (ModelConfig fields, the same as flags)
FLAGS = {
    "kv-channels": ({"kv_channels": 12}, ["--kv-channels", "12"]),
    "kv-channels-rope-gqa": (
        {"kv_channels": 6, "num_query_groups": 2, **ROPE},
        ["--kv-channels", "6", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope"],
    ),
    "qk-layernorm": ({"qk_layernorm": True}, ["--qk-layernorm"]),
    "qk-layernorm-rmsnorm": (
        {"qk_layernorm": True, "normalization": "RMSNorm"},
        ["--qk-layernorm", "--normalization", "RMSNorm"],
    ),
    "rotary-percent": (
        {"rotary_percent": 0.5, **ROPE},
        ["--use-rotary-position-embeddings", "--rotary-percent", "0.5"],
    ),
    "squared-relu": ({"squared_relu": True}, ["--squared-relu"]),
    "post-layernorm-residual": (
        {"apply_residual_connection_post_layernorm": True},
        ["--apply-residual-connection-post-layernorm"],
    ),
    "all": (
        {"kv_channels": 12, "qk_layernorm": True, "rotary_percent": 0.5, "rotary_base": 500,
         "squared_relu": True, "apply_residual_connection_post_layernorm": True,
         "normalization": "RMSNorm", "num_query_groups": 2, **ROPE},
        ["--kv-channels", "12", "--qk-layernorm", "--rotary-percent", "0.5", "--rotary-base",
         "500", "--squared-relu", "--apply-residual-connection-post-layernorm",
         "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--use-rotary-position-embeddings"],
    ),
}  # fmt: skip
# Each case without its flag(s): the control that the flag changes the model at all.
WITHOUT = {
    "kv-channels": {"kv_channels": None},
    "kv-channels-rope-gqa": {"kv_channels": None},
    "qk-layernorm": {"qk_layernorm": False},
    "qk-layernorm-rmsnorm": {"qk_layernorm": False},
    "rotary-percent": {"rotary_percent": 1.0},
    "squared-relu": {"squared_relu": False},
    "post-layernorm-residual": {"apply_residual_connection_post_layernorm": False},
    "all": {"rotary_percent": 1.0, "apply_residual_connection_post_layernorm": False},
}


def config_of(case: str, **changes) -> ModelConfig:
    return dataclasses.replace(BASE, **{**FLAGS[case][0], **changes})


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), [2, SEQ] each."""
    g = torch.Generator().manual_seed(seed)
    tokens, labels = torch.randint(0, VOCAB, (2, 2, SEQ), generator=g)
    return tokens, labels


def single_model(config: ModelConfig, seed: int = 7) -> GPTModel:
    return GPTModel(config, ParallelState.single(), RNGTracker(seed), seed=seed)


# --- flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(FLAGS))
def test_flags_set_the_model_fields(case: str) -> None:
    fields, flags = FLAGS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parse_args(argv(hidden_size=32, seq_length=SEQ) + flags, 1).model
    for name, value in fields.items():
        assert getattr(model, name) == value, name


def test_the_older_rope_spelling_and_its_contradiction() -> None:
    def model(*flags: str) -> ModelConfig:
        return parse_args(argv() + list(flags), 1).model

    assert model().position_embedding_type == "learned_absolute"
    assert model("--use-rotary-position-embeddings").position_embedding_type == "rope"
    same = model("--use-rotary-position-embeddings", "--position-embedding-type", "rope")
    assert same.position_embedding_type == "rope"
    with pytest.raises(ConfigError) as info:
        model("--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute")
    message = str(info.value)
    assert "--use-rotary-position-embeddings" in message and "--position-embedding-type" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--squared-relu", "--swiglu"], "--squared-relu with --swiglu"),
        (["--squared-relu", "--openai-gelu"], "--squared-relu with --openai-gelu"),
        (["--kv-channels", "0"], "--kv-channels must be positive, got 0"),
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5 needs rotary embeddings"),
        (["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
         "--rotary-percent must be in (0, 1], got 1.5"),
        (["--position-embedding-type", "rope", "--kv-channels", "10", "--rotary-percent", "0.1"],
         "int(--kv-channels 10 x --rotary-percent 0.1) = 1"),
    ],
)  # fmt: skip
def test_contradictions_are_one_line(flags: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv() + flags, 1)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_kv_channels_lifts_the_hidden_by_heads_rule() -> None:
    model = parse_args(argv(hidden_size=36, num_attention_heads=8, kv_channels=8), 1).model
    assert model.head_dim == 8
    with pytest.raises(ConfigError, match="--hidden-size"):
        parse_args(argv(hidden_size=36, num_attention_heads=8), 1)


def test_post_layernorm_residual_is_refused_with_transformer_engine() -> None:
    config = config_of("post-layernorm-residual")
    training = TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=1, lr=1e-3)
    te = KernelConfig(transformer_impl="transformer_engine")
    with pytest.raises(ConfigError, match="--apply-residual-connection-post-layernorm with "
                       "--transformer-impl transformer_engine"):  # fmt: skip
        validate_configs(config, ParallelConfig(), training, 1, kernels=te)
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine"):
        use_transformer_engine(None, config, None, te, sequence_parallel=False, output_init_std=1)


# --- the independent reference ------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(FLAGS))
def test_losses_and_gradients_equal_the_plain_reference(case: str) -> None:
    config = config_of(case)
    model = single_model(config)
    plain = reference_from_megapipe(model)
    tokens, labels = batch()
    ours, theirs = model(tokens, labels=labels), plain(tokens, labels)
    ours.mean().backward()
    theirs.mean().backward()
    loss_diff = (ours - theirs).abs().max().item()
    params = dict(plain.named_parameters())
    grad_diff = max(
        (p.grad - params[plain_name(n)].grad).abs().max().item()
        for n, p in model.named_parameters()
    )
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    print(f"\n{case}: max |loss diff| {loss_diff:.3g}, max |grad diff| {grad_diff:.3g} "
          f"(largest gradient {scale:.3g})")  # fmt: skip
    assert loss_diff < 1e-5
    assert grad_diff < 1e-5 * scale
    # control: the flag changes the model (the shared parameters start equal: init depends
    # on the seed and the parameter's name and shape only), so the comparison above tests it
    without = single_model(config_of(case, **WITHOUT[case]))
    with torch.no_grad():
        assert (without(tokens, labels=labels) - ours).abs().max().item() > 1e-3


def test_partial_rotary_leaves_the_rest_of_each_head_alone() -> None:
    model = single_model(config_of("rotary-percent"))
    x = torch.randn(SEQ, 2, 4, 8)
    rotated = model.rotary(x, offset=3)
    assert model.rotary.rotary_dim == 4 and model.rotary.cos.shape[-1] == 4
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    assert not torch.allclose(rotated[..., :4], x[..., :4])
    # a fused rotary kernel rotates whole heads: a partial rotation takes the reference path
    kernel = rotary_reference
    assert RotaryEmbedding(8, SEQ, kernel=kernel).kernel is kernel
    assert RotaryEmbedding(8, SEQ, kernel=kernel, rotary_dim=4).kernel is None


def test_qk_norms_are_replicated_with_tp_summed_gradients_and_megatron_names() -> None:
    config = config_of("all")
    model = single_model(config)
    names = [n for n, _ in model.named_parameters() if "layernorm" in n and "self_att" in n]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in names
    assert logical_name("decoder.layers.1.self_attention.q_layernorm.weight") == (
        "decoder.layers.self_attention.q_layernorm.weight",
        1,
    )
    name = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert model.get_parameter(name).shape == (12,)
    (tp_rank_1,) = build_rank(config, 1, 2, 0, [range(2)], 1)
    norm = tp_rank_1.get_parameter(name)  # whole on each TP rank, which sees its own heads only:
    assert norm.shape == (12,) and norm.meta.tp_dim is None
    assert norm.meta.sequence_parallel  # so its gradient is summed over TP, as SP norms' are


# --- TP=2 parity --------------------------------------------------------------------------------

PARITY = {
    "kv-channels": ["--kv-channels", "12"],
    "qk-layernorm": ["--qk-layernorm"],
    "rotary-percent": ["--position-embedding-type", "rope", "--rotary-percent", "0.5"],
    "squared-relu": ["--squared-relu"],
    "post-layernorm-residual": ["--apply-residual-connection-post-layernorm"],
    "all-sequence-parallel": FLAGS["all"][1] + ["--sequence-parallel"],
}
TP2 = ["--tensor-model-parallel-size", "2"]


def _every_case(rank: int, world: int, extra: list[str]) -> dict:
    return {
        case: parity_losses_and_norms(rank, world, ["--num-layers", "2", *flags, *extra])
        for case, flags in PARITY.items()
    }


@pytest.fixture(scope="module")
def parity_runs() -> tuple[dict, list[dict]]:
    return run_distributed(_every_case, 1, [])[0], run_distributed(_every_case, 2, TP2)


@pytest.mark.parametrize("case", sorted(PARITY))
def test_tensor_parallel_training_equals_one_rank(parity_runs, case: str) -> None:
    one, ranks = parity_runs
    losses, norms = one[case]
    for rank_losses, rank_norms in (r[case] for r in ranks):
        worst = max(
            abs(a - b) / abs(b)
            for a, b in zip(rank_losses + rank_norms, losses + norms, strict=True)
        )
        print(f"\n{case}: TP2 vs 1 rank, worst relative difference {worst:.3g}")
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        assert rank_norms == pytest.approx(norms, rel=1e-5)


# --- counts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["kv-channels", "qk-layernorm", "all"])
def test_parameter_counts_are_the_built_models(case: str) -> None:
    config = dataclasses.replace(config_of(case), num_layers=3)
    for tp, ranges in ((2, [range(0, 2), range(2, 3)]), (1, [range(0, 3)])):
        pp = len(ranges)
        for stage, layers in enumerate(ranges):
            (model,) = build_rank(config, 0, tp, stage, [layers], pp)
            built = sum(p.numel() for p in model.parameters())
            assert stage_parameters(config, len(layers), stage == 0, stage == pp - 1, tp) == built


def test_flops_count_the_head_dimension() -> None:
    config = config_of("kv-channels-rope-gqa")  # 4 heads x 6 (not 32 / 4), 2 query groups
    b, s, h, n, g, d, f = 4, SEQ, 32, 4, 2, 6, config.ffn_hidden_size

    def per_layer(model: ModelConfig) -> int:
        def at(layers: int) -> int:
            changed = dataclasses.replace(model, num_layers=layers)
            return flops_per_iteration(changed, b, padded_vocab_size=VOCAB)

        return at(1) - at(0)

    by_hand = 3 * (2 * b * s * h * d * (n + 2 * g) + 2 * b * n * s * s * d + 2 * b * s * n * d * h
                   + 2 * b * s * h * f * 2)  # fmt: skip
    assert per_layer(config) == by_hand
    assert per_layer(config) == 3 * b * s * layer_flops_per_token(config)  # the partition's


def _measured_activation_bytes(config: ModelConfig) -> int:
    layer = TransformerLayer(config, ParallelState.single().tp, RNGTracker(1),
                             sequence_parallel=False).train()  # fmt: skip
    x = torch.randn(SEQ, 2, config.hidden_size, requires_grad=True)
    return saved_activation_bytes(lambda: layer(x), layer.parameters())


@pytest.mark.parametrize(
    "case", ["kv-channels", "qk-layernorm", "squared-relu", "post-layernorm-residual"]
)
def test_activation_memory_formula_follows_the_flags(case: str) -> None:
    config = config_of(case)
    assert _measured_activation_bytes(config) == layer_activation_bytes(config, 2)


# --- generation and checkpoints -----------------------------------------------------------------

TRAIN = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
    "16", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size",
    "4", "--lr", "1e-2", "--log-interval", "10", "--eval-iters", "0", "--train-iters", "3",
]  # fmt: skip
GENERATION = [
    "--kv-channels", "12", "--qk-layernorm", "--position-embedding-type", "rope",
    "--rotary-percent", "0.5", "--rotary-base", "500", "--group-query-attention",
    "--num-query-groups", "2",
]  # fmt: skip
NORMS = ("decoder.layers.self_attention.q_layernorm.weight",
         "decoder.layers.self_attention.k_layernorm.bias")  # fmt: skip


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model with the generation flags trained 3 steps at TP=2 and saved in each format."""
    root = tmp_path_factory.mktemp("model_flags")
    save = ["--save", str(root / "ckpt"), "--ckpt-format", request.param]
    run(2, TRAIN + MOCK + NO_DROPOUT + GENERATION + TP2 + save)
    return root / "ckpt"


def test_checkpoint_round_trip_keeps_the_qk_norms(checkpoint: Path) -> None:
    source = read_source(resolve(str(checkpoint))[0], say=lambda _: None)
    assert source.config.kv_channels == 12 and source.config.qk_layernorm
    assert source.config.rotary_percent == 0.5
    for key in NORMS:
        saved = source.tensors[key]
        assert saved.shape == (2, 12)
        init = 1.0 if key.endswith("weight") else 0.0
        assert (saved - init).abs().max() > 1e-4, "the norms trained: a real round trip"
    loaded = load_inference_model(str(checkpoint), ParallelState.single()).model
    for key in NORMS:
        for layer in range(2):
            name = key.replace("decoder.layers.", f"decoder.layers.{layer}.")
            assert torch.equal(loaded.get_parameter(name).detach(), source.tensors[key][layer])


def test_kv_cache_generation_equals_the_full_forward(checkpoint: Path) -> None:
    m = load_inference_model(str(checkpoint), ParallelState.single())
    rotary = m.model.rotary  # the saved run's --rotary-base and --rotary-percent
    assert (rotary.base, rotary.rotary_dim, rotary.head_dim) == (500, 6, 12)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 8, 64, 11, 27, 90, 1, 2, 33, 71, 50, 6]] * 2)
    tokens[1] = tokens[1].flip(0)
    with torch.no_grad():
        full = m.model(tokens=tokens)  # [s, b, vocab]
        cache = KVCache(2, tokens.shape[1])
        pieces = []
        for start, stop in ((0, 5), *((i, i + 1) for i in range(5, tokens.shape[1]))):
            pieces.append(m.model(tokens=tokens[:, start:stop], kv_cache=cache))
            cache.advance(stop - start)
    diff = (torch.cat(pieces) - full).abs().max().item()
    print(f"\nKV cache vs full forward: max |logit diff| {diff:.3g}")
    assert diff < 1e-5
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44]]
    for options in (SamplingOptions(greedy=True), SamplingOptions(temperature=1.5, top_k=20)):
        cached = generate(m, prompts, 10, options, seed=3)
        recomputed = generate(m, prompts, 10, options, seed=3, use_cache=False)
        assert [g.tokens for g in cached] == [g.tokens for g in recomputed]


# --- Hugging Face export ------------------------------------------------------------------------


def test_llama_with_kv_channels_exports_and_imports(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    llama = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
             "--disable-bias-linear", "--kv-channels", "12", "--group-query-attention",
             "--num-query-groups", "2"]  # fmt: skip
    run(1, TRAIN + MOCK + NO_DROPOUT + llama + ["--save", str(tmp_path / "ckpt")])
    assert tool("--saver", "hf", "--load-dir", str(tmp_path / "ckpt"),
                "--save-dir", str(tmp_path / "hf")) == 0  # fmt: skip
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_dim"] == 12
    source = read_source(resolve(str(tmp_path / "ckpt"))[0], say=lambda _: None)
    (model,) = build_rank(source.config, 0, 1, 0, [range(2)], 1)
    _fill([model], source, 0, 1)
    tokens = batch()[0] % source.config.vocab_size
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        ours = model.eval()(tokens=tokens).transpose(0, 1)[..., : source.config.vocab_size]
        theirs = hf.eval()(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"\nLlama with head_dim 12: export max |logit diff| {diff:.3g}")
    assert diff < 1e-4
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"),
                "--save-dir", str(tmp_path / "back")) == 0  # fmt: skip
    back = read_source(resolve(str(tmp_path / "back"))[0], say=lambda _: None)
    assert back.config.kv_channels == 12
    for key, tensor in source.tensors.items():
        assert torch.equal(back.tensors[key], tensor), key


LLAMA_FIELDS = dict(normalization="RMSNorm", swiglu=True, **ROPE)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"qk_layernorm": True}, "--qk-layernorm"),
        ({"qk_layernorm": True, **LLAMA_FIELDS}, "--qk-layernorm"),
        ({"squared_relu": True}, "--squared-relu"),
        ({"apply_residual_connection_post_layernorm": True},
         "--apply-residual-connection-post-layernorm"),
        ({"kv_channels": 12}, "--kv-channels 12 with learned positions"),
        ({"rotary_percent": 0.5, **LLAMA_FIELDS}, "--rotary-percent 0.5"),
    ],
)  # fmt: skip
def test_export_refuses_what_gpt2_and_llama_cannot_express(fields: dict, says: str) -> None:
    config = dataclasses.replace(BASE, init_method_std=0.02, **fields)
    with pytest.raises(ConfigError) as info:
        architecture(config)
    assert says in str(info.value) and "has no Hugging Face equivalent" in str(info.value)
    plain = dataclasses.replace(
        config, kv_channels=None, qk_layernorm=False, squared_relu=False, rotary_percent=1.0,
        apply_residual_connection_post_layernorm=False,
    )  # fmt: skip
    assert architecture(plain) in ("gpt2", "llama")  # the refusal was the flag's
