"""--transformer-impl transformer_engine and FP8.

On CPU (never skipped): the pure decisions (TE / FP8 allowed for (TE usable, device type,
compute capability)), the --fp8-* flags, the FP8 recipe's arguments, the layer-construction
specs checked against megapipe's own layer built from the same config, the parameter-name
mapping checked against Megatron-Core's TE names (DESIGN.md), and the adapter's wiring run on a
plain-torch stand-in for TE's Linear / LayerNormLinear (their documented one-rank contract): the
TE-built model must hold the local model's weights under the mapped names and give its loss
and gradients. With TransformerEngine and CUDA (skipped otherwise, with the reason): the real TE
layers against the local model, and FP8 training on a GPU with FP8 tensor cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import math

import pytest
import te_stub
import torch

from megapipe.arguments.kernel_flags import add_kernel_args, kernel_config
from megapipe.config import KernelConfig, ModelConfig
from megapipe.errors import ConfigError
from megapipe.kernels.availability import Availability, Probe
from megapipe.kernels.dispatch import IMPLEMENTATIONS, KernelChoices, KernelSettings, choose_kernels
from megapipe.kernels.transformer_engine import (
    check_fp8_recipe,
    check_transformer_engine,
    fp8_recipe_kwargs,
)
from megapipe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megapipe.model.gpt import GPTModel
from megapipe.model.te_layers import (
    local_parameter_name,
    local_state_dict,
    te_layer_specs,
    te_parameter_name,
)
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState

TE = Probe(True, "transformer_engine.pytorch")
NO_TE = Probe(False, "import transformer_engine.pytorch failed: ModuleNotFoundError: no")
GPT2 = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=50,
    seq_length=8,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
LLAMA = dict(
    GPT2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _error(**kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        check_transformer_engine(**kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


# ---- who may use TE and FP8: a pure function of (TE usable, device, capability) ----


def test_local_without_fp8_is_allowed_anywhere() -> None:
    for device, capability in (("cpu", None), ("cuda", (7, 0)), ("cuda", (9, 0))):
        check_transformer_engine("local", None, te=NO_TE, device_type=device, capability=capability)


def test_transformer_engine_needs_cuda_and_te() -> None:
    message = _error(
        transformer_impl="transformer_engine",
        fp8_format=None,
        te=TE,
        device_type="cpu",
        capability=None,
    )
    assert message.startswith("--transformer-impl transformer_engine: ") and "CUDA" in message
    message = _error(
        transformer_impl="transformer_engine",
        fp8_format=None,
        te=NO_TE,
        device_type="cuda",
        capability=(9, 0),
    )
    assert message.startswith("--transformer-impl transformer_engine: ")
    assert NO_TE.reason in message
    check_transformer_engine(
        "transformer_engine", None, te=TE, device_type="cuda", capability=(8, 0)
    )  # bf16 TE on an A100 is fine


def test_fp8_needs_transformer_engine() -> None:
    message = _error(
        transformer_impl="local", fp8_format="hybrid", te=TE, device_type="cuda", capability=(9, 0)
    )
    assert message.startswith("--fp8-format hybrid needs --transformer-impl transformer_engine")


@pytest.mark.parametrize(
    "capability, allowed",
    [
        ((7, 0), False),
        ((8, 0), False),
        ((8, 6), False),
        ((8, 9), True),
        ((9, 0), True),
        ((10, 0), True),
        (None, True),
    ],
)
def test_fp8_needs_compute_capability_8_9(capability, allowed) -> None:
    kwargs = dict(
        transformer_impl="transformer_engine",
        fp8_format="e4m3",
        te=TE,
        device_type="cuda",
        capability=capability,
    )
    if allowed:
        check_transformer_engine(**kwargs)
    else:
        message = _error(**kwargs)
        assert message.startswith("--fp8-format e4m3: ")
        assert f"{capability[0]}.{capability[1]}" in message and "8.9" in message


def test_unknown_fp8_format_and_bad_recipe_values_are_named() -> None:
    assert _error(
        transformer_impl="transformer_engine",
        fp8_format="e5m2",
        te=TE,
        device_type="cuda",
        capability=(9, 0),
    ).startswith("--fp8-format e5m2: ")
    for args, flag in (
        ((0, 0, "max"), "--fp8-amax-history-len"),
        ((-1, 16, "max"), "--fp8-margin"),
        ((0, 16, "mean"), "--fp8-amax-compute-algo"),
    ):
        with pytest.raises(ConfigError, match=flag):
            check_fp8_recipe(*args)
    check_fp8_recipe(0, 1, "most_recent")


def test_dispatch_checks_fp8_against_the_devices_capability() -> None:
    avail = Availability(*(Probe(True, "here") for _ in range(4)))
    settings = KernelSettings(transformer_impl="transformer_engine", fp8_format="hybrid")
    with pytest.raises(ConfigError, match=r"--fp8-format hybrid: .* 8\.0"):
        choose_kernels(settings, "cuda", avail, capability=(8, 0))
    choices = choose_kernels(settings, "cuda", avail, capability=(9, 0))
    assert choices.chosen["layer_norm"] == choices.chosen["rms_norm"] == "te"
    with pytest.raises(ConfigError, match="--fp8-format hybrid needs --transformer-impl"):
        choose_kernels(KernelSettings(fp8_format="hybrid"), "cuda", avail, capability=(9, 0))


# ---- the --fp8-* flags ----


def _parse(*argv: str) -> KernelConfig:
    parser = argparse.ArgumentParser()
    add_kernel_args(parser.add_argument_group("kernels"))
    return kernel_config(parser.parse_args(list(argv)))


def test_fp8_flags_default_to_megatrons_values_and_no_fp8() -> None:
    config = _parse()
    assert (
        config.fp8_format,
        config.fp8_margin,
        config.fp8_amax_history_len,
        config.fp8_amax_compute_algo,
    ) == (None, 0, 1024, "max")
    assert fp8_recipe_kwargs(config) is None


def test_fp8_without_transformer_engine_is_refused_at_parse_time() -> None:
    with pytest.raises(ConfigError, match="^--fp8-format hybrid needs --transformer-impl"):
        _parse("--fp8-format", "hybrid", "--fp8-amax-history-len", "16")
    with pytest.raises(ConfigError, match="--fp8-amax-history-len 0"):
        _parse("--fp8-amax-history-len", "0")


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="TransformerEngine is installed here",
)
def test_transformer_engine_flag_without_te_names_what_is_missing() -> None:
    with pytest.raises(
        ConfigError, match="^--transformer-impl transformer_engine: .*not installed"
    ):
        _parse("--transformer-impl", "transformer_engine", "--fp8-format", "e4m3")


def test_fp8_recipe_kwargs_are_delayed_scalings_arguments() -> None:
    config = KernelConfig(
        transformer_impl="transformer_engine",
        fp8_format="hybrid",
        fp8_margin=1,
        fp8_amax_history_len=16,
        fp8_amax_compute_algo="most_recent",
    )
    assert fp8_recipe_kwargs(config) == {
        "margin": 1,
        "fp8_format": "HYBRID",
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
    }


# ---- layer construction: TE kwargs against megapipe's own layer of the same config ----


def _local_layer(shape: dict, tp_size: int, sp: bool) -> TransformerLayer:
    """megapipe's layer as one rank of a TP group of tp_size builds it (no collectives run)."""
    config = ModelConfig(**shape)
    return config, TransformerLayer(
        config, Group(tuple(range(tp_size)), 0), RNGTracker(0), sequence_parallel=sp
    )


@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("tp_size, sp", [(1, False), (2, False), (4, True)])
def test_te_specs_match_the_local_layer(shape, tp_size, sp) -> None:
    config, layer = _local_layer(shape, tp_size, sp)
    scaled = config.init_method_std / math.sqrt(2 * config.num_layers)  # Megatron's output init
    specs = te_layer_specs(
        config,
        tp_size,
        sequence_parallel=sp,
        output_init_std=scaled,
        fc1_skip_bias_add=layer.mlp.linear_fc1.skip_bias_add,
    )
    local_params = dict(layer.named_parameters())
    covered = [name for spec in specs.values() for name in spec.params.values()]
    assert sorted(covered) == sorted(local_params)  # every parameter, exactly once
    for site, spec in specs.items():
        local = layer.get_submodule(site)
        kwargs = spec.kwargs
        weight = local.weight.shape
        if isinstance(local, ColumnParallelLinear):
            assert kwargs["parallel_mode"] == "column"
            assert (kwargs["out_features"] // tp_size, kwargs["in_features"]) == weight
        else:
            assert isinstance(local, RowParallelLinear) and kwargs["parallel_mode"] == "row"
            assert (kwargs["out_features"], kwargs["in_features"] // tp_size) == weight
        assert kwargs["bias"] == (local.bias is not None) == config.add_bias_linear
        assert kwargs["sequence_parallel"] == local.sequence_parallel == (sp and tp_size > 1)
        assert kwargs["tp_size"] == tp_size and kwargs["params_dtype"] == torch.float32
        assert spec.returns_bias == local.skip_bias_add
        assert spec.init_std == local.weight.meta.init_std
        if spec.te_class == "LayerNormLinear":
            norm = layer.get_submodule(spec.params["layer_norm_weight"].rpartition(".")[0])
            assert kwargs["normalization"] == type(norm).__name__ == config.normalization
            assert kwargs["eps"] == norm.eps
        else:
            assert spec.te_class == "Linear" and "normalization" not in kwargs


def test_names_map_to_megatron_cores_te_names_and_back() -> None:
    """DESIGN.md: input_layernorm.* -> self_attention.linear_qkv.layer_norm_weight/_bias,
    pre_mlp_layernorm.* -> mlp.linear_fc1.layer_norm_weight/_bias; linears keep theirs."""
    config = ModelConfig(**GPT2)
    prefix = "decoder.layers.1."
    expected = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
        "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
        "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
        "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
    }
    for local, te in expected.items():
        assert te_parameter_name(prefix + local, config) == prefix + te
        assert local_parameter_name(prefix + te, config) == prefix + local
    for name in ("decoder.final_layernorm.weight", "embedding.word_embeddings.weight"):
        assert te_parameter_name(name, config) == name == local_parameter_name(name, config)


# ---- the adapter's wiring, on a plain-torch stand-in for TE's one-rank modules ----


@pytest.fixture
def stub_te(monkeypatch):
    te_stub.install(monkeypatch)


REFERENCE = KernelChoices("cpu", {op: "reference" for op in IMPLEMENTATIONS}, {}, IMPLEMENTATIONS)


@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_te_built_model_holds_the_local_weights_and_gives_its_loss(shape, stub_te) -> None:
    config = ModelConfig(**shape)
    tokens = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(0))
    models, results = [], []
    for impl in ("local", "transformer_engine"):
        model = GPTModel(
            config,
            ParallelState.single(),
            RNGTracker(5),
            seed=5,
            kernels=KernelConfig(transformer_impl=impl),
            kernel_choices=REFERENCE,
        ).train()
        loss = model(tokens=tokens, labels=tokens).mean()
        loss.backward()
        models.append(model)
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    local, te = models
    layer = te.decoder.layers["0"]
    assert isinstance(layer.self_attention.linear_qkv, te_stub.StubLayerNormLinear)
    assert isinstance(layer.mlp.linear_fc1, te_stub.StubLayerNormLinear)
    for row in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
        assert isinstance(row, te_stub.StubLinear)
        assert not isinstance(row, te_stub.StubLayerNormLinear)
    assert isinstance(layer.input_layernorm, torch.nn.Identity)
    te_params = dict(te.named_parameters())
    local_params = dict(local.named_parameters())
    assert sorted(te_params) == sorted(te_parameter_name(n, config) for n in local_params)
    for name, param in local_params.items():
        te_param = te_params[te_parameter_name(name, config)]
        assert te_param.meta == param.meta, name
        torch.testing.assert_close(te_param, param, rtol=0, atol=0, msg=name)
    (local_loss, local_grads), (te_loss, te_grads) = results
    torch.testing.assert_close(te_loss, local_loss, rtol=1e-6, atol=1e-6)
    for name, grad in local_grads.items():
        torch.testing.assert_close(
            te_grads[te_parameter_name(name, config)], grad, rtol=1e-5, atol=1e-7, msg=name
        )
    state = dict(te.state_dict(), **{"decoder.layers.0.mlp.linear_fc1._extra_state": b""})
    fresh = GPTModel(
        config, ParallelState.single(), RNGTracker(6), seed=6, kernel_choices=REFERENCE
    )
    fresh.load_state_dict(local_state_dict(state, config), strict=True)
    torch.testing.assert_close(fresh(tokens=tokens, labels=tokens).mean(), local_loss)


# ---- the real TransformerEngine (a CUDA machine with TE installed) ----

_HAS_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(
    not (_HAS_TE and torch.cuda.is_available()),
    reason="needs TransformerEngine and a CUDA device (not installable / absent here)",
)


def _cuda_choices() -> KernelChoices:
    return choose_kernels(KernelSettings(transformer_impl="transformer_engine"), "cuda")


@needs_te
@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_real_te_layers_give_the_local_models_loss(shape) -> None:
    config = ModelConfig(**dict(shape, hidden_size=64, seq_length=16))
    tokens = torch.randint(50, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    state = ParallelState.single("cuda")
    losses = []
    for impl in ("local", "transformer_engine"):
        model = GPTModel(
            config,
            state,
            RNGTracker(5, device="cuda"),
            seed=5,
            kernels=KernelConfig(transformer_impl=impl),
        ).train()
        losses.append(model(tokens=tokens, labels=tokens).mean())
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=2e-3)


@needs_te
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 needs compute capability >= 8.9",
)
def test_fp8_training_steps_lower_the_loss() -> None:
    config = ModelConfig(**dict(GPT2, hidden_size=128, num_attention_heads=4, seq_length=32))
    kernels = KernelConfig(
        transformer_impl="transformer_engine", fp8_format="hybrid", fp8_amax_history_len=16
    )
    model = (
        GPTModel(
            config,
            ParallelState.single("cuda"),
            RNGTracker(5, device="cuda"),
            seed=5,
            kernels=kernels,
        )
        .to(torch.bfloat16)
        .train()
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(50, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for _ in range(8):
        loss = model(tokens=tokens, labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


def test_fp8_runs_each_chunk_forward_under_one_autocast_with_the_flags_recipe(stub_te) -> None:
    config = ModelConfig(**GPT2)
    kernels = KernelConfig(transformer_impl="transformer_engine", fp8_format="e4m3",
                           fp8_margin=2, fp8_amax_history_len=16,
                           fp8_amax_compute_algo="most_recent")  # fmt: skip
    model = GPTModel(config, ParallelState.single(), RNGTracker(5), seed=5, kernels=kernels,
                     kernel_choices=REFERENCE)  # fmt: skip
    tokens = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens=tokens, labels=tokens)
    assert len(te_stub.AUTOCASTS) == 1  # once per chunk forward (it was once per TE module: 8)
    recipe, group = te_stub.AUTOCASTS[0]
    assert recipe == te_stub.StubDelayedScaling(
        margin=2,
        fp8_format=te_stub.StubFormat.E4M3,
        amax_history_len=16,
        amax_compute_algo="most_recent",
        reduce_amax=False,
    )  # one TP rank: no amax all-reduce
    assert group is None
    plain = GPTModel(config, ParallelState.single(), RNGTracker(5), seed=5,
                     kernels=KernelConfig(transformer_impl="transformer_engine"),
                     kernel_choices=REFERENCE)  # fmt: skip
    te_stub.AUTOCASTS.clear()
    plain(tokens=tokens, labels=tokens)
    assert te_stub.AUTOCASTS == []  # no --fp8-format: no autocast
