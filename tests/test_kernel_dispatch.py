"""Which implementation each op gets: the reference on CPU whatever is installed; on CUDA (a
decision made here for a machine we are not on, from explicit availability) the best one that
can run, the reference when Triton, apex or TE is missing or a fusion flag is off, and a
one-line ConfigError for a forced choice that cannot run. Plus the probes themselves."""

from __future__ import annotations

import argparse
import subprocess
import sys
from types import MappingProxyType

import pytest
import torch

from megapipe.config import KernelConfig
from megapipe.errors import ConfigError
from megapipe.kernels import availability, bias_gelu, norm_backends
from megapipe.kernels.availability import Availability, Probe
from megapipe.kernels.dispatch import (
    IMPLEMENTATIONS,
    KernelSettings,
    choose_kernels,
)

ELEMENTWISE = ("bias_gelu", "bias_dropout_add", "swiglu", "rotary")


def available(**missing: str) -> Availability:
    """Everything available except the named libraries, whose value is the reason."""
    probes = {name: Probe(True, f"{name} here") for name in ("triton", "apex", "te", "flash_attn")}
    probes.update({name: Probe(False, reason) for name, reason in missing.items()})
    return Availability(**probes)


def _impl(name: str):
    """A stand-in row entry for ops whose modules are not under test here."""
    return lambda *args: name


# a table with norm-like rows (apex / te / triton) beside the real elementwise rows
NORM_TABLE = MappingProxyType(
    {
        **IMPLEMENTATIONS,
        "layer_norm": {n: _impl(n) for n in ("reference", "triton", "apex", "te")},
        "cross_entropy": {n: _impl(n) for n in ("reference", "triton")},
    }
)


def test_cpu_runs_every_reference_even_with_everything_installed() -> None:
    for avail in (None, available(), Availability.nothing()):
        choices = choose_kernels(KernelSettings(), "cpu", avail)
        assert set(choices.chosen) == set(IMPLEMENTATIONS)
        assert set(choices.chosen.values()) == {"reference"}
    assert choices.op("bias_gelu") is bias_gelu.bias_gelu_reference
    assert choices.describe() == "kernels: " + ", ".join(
        f"{op}=reference" for op in IMPLEMENTATIONS
    )
    assert choices.describe().startswith(
        "kernels: bias_gelu=reference, bias_dropout_add=reference, swiglu=reference, "
        "rotary=reference"
    )


def test_cuda_with_triton_runs_the_triton_kernels() -> None:
    choices = choose_kernels(KernelSettings(), "cuda", available())
    assert [choices.chosen[op] for op in ELEMENTWISE] == ["triton"] * 4
    assert choices.op("bias_gelu") is bias_gelu.bias_gelu_triton
    assert choices.describe().startswith("kernels: bias_gelu=triton, bias_dropout_add=triton")


def test_cuda_without_triton_falls_back_to_the_reference_and_says_why() -> None:
    choices = choose_kernels(KernelSettings(), "cuda:0", available(triton="import triton failed"))
    assert [choices.chosen[op] for op in ELEMENTWISE] == ["reference"] * 4
    assert choices.reasons["swiglu"] == "triton: import triton failed"


def test_fusion_flags_turn_single_ops_off() -> None:
    settings = KernelSettings(bias_gelu_fusion=False, rope_fusion=False)
    choices = choose_kernels(settings, "cuda", available())
    assert choices.chosen["bias_gelu"] == choices.chosen["rotary"] == "reference"
    assert choices.chosen["swiglu"] == choices.chosen["bias_dropout_add"] == "triton"
    assert "--no-bias-gelu-fusion" in choices.reasons["bias_gelu"]
    assert "--no-rope-fusion" in choices.reasons["rotary"]


def test_norms_prefer_te_under_transformer_engine_then_apex_then_triton() -> None:
    pick = lambda settings, avail: choose_kernels(settings, "cuda", avail, NORM_TABLE).chosen
    te = KernelSettings(transformer_impl="transformer_engine")
    assert pick(te, available())["layer_norm"] == "te"
    assert pick(te, available())["bias_gelu"] == "triton"  # no te row: the next best
    assert pick(KernelSettings(), available())["layer_norm"] == "apex"
    assert pick(KernelSettings(), available(apex="no apex"))["layer_norm"] == "triton"
    nothing = available(apex="no apex", triton="no triton")
    assert pick(KernelSettings(), nothing)["layer_norm"] == "reference"
    choices = choose_kernels(KernelSettings(), "cuda", nothing, NORM_TABLE)
    assert choices.reasons["layer_norm"] == "apex: no apex; triton: no triton"
    assert choices.op("layer_norm")() == "reference"


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_real_norm_rows_apex_and_te_are_chosen_on_cuda_when_present(op) -> None:
    """The table's own apex / TE rows (not stand-ins): apex first under local, TE's under
    transformer_engine, then Triton, then the reference; always the reference on CPU."""
    kind = "layer_norm" if op == "layer_norm" else "rms_norm"
    apex_fn = getattr(norm_backends, f"apex_{kind}")
    te_fn = getattr(norm_backends, f"te_{kind}")
    local, te = KernelSettings(), KernelSettings(transformer_impl="transformer_engine")
    assert choose_kernels(local, "cuda", available()).op(op) is apex_fn
    assert choose_kernels(te, "cuda", available()).op(op) is te_fn
    assert choose_kernels(te, "cuda", available(apex="no apex")).op(op) is te_fn
    no_apex = choose_kernels(local, "cuda", available(apex="apex has no normalization"))
    assert no_apex.chosen[op] == "triton"
    nothing = choose_kernels(local, "cuda", available(apex="no apex", triton="no triton"))
    assert nothing.chosen[op] == "reference"
    assert nothing.reasons[op] == "apex: no apex; triton: no triton"
    assert choose_kernels(local, "cpu", available()).chosen[op] == "reference"


@pytest.mark.parametrize("fn", ["apex_layer_norm", "apex_rms_norm", "te_layer_norm", "te_rms_norm"])
def test_apex_and_te_norm_rows_refuse_cpu_tensors_in_one_line(fn) -> None:
    x, weight = torch.randn(2, 8), torch.ones(8)
    args = (x, weight, None, 1e-5) if "layer" in fn else (x, weight, 1e-5)
    with pytest.raises(RuntimeError, match="need CUDA tensors") as error:
        getattr(norm_backends, fn)(*args)
    assert "\n" not in str(error.value)


def test_cross_entropy_fusion_is_opt_in_as_in_megatron() -> None:
    off = choose_kernels(KernelSettings(), "cuda", available(), NORM_TABLE)
    assert off.chosen["cross_entropy"] == "reference"
    assert "--cross-entropy-loss-fusion" in off.reasons["cross_entropy"]
    on = choose_kernels(
        KernelSettings(cross_entropy_loss_fusion=True), "cuda", available(), NORM_TABLE
    )
    assert on.chosen["cross_entropy"] == "triton"


def test_compile_only_where_asked_and_only_on_cuda() -> None:
    settings = KernelSettings(compile_ops=("swiglu",))
    assert choose_kernels(settings, "cuda", available()).chosen["swiglu"] == "compile"
    assert choose_kernels(settings, "cuda", available()).chosen["bias_gelu"] == "triton"
    assert choose_kernels(settings, "cpu", available()).chosen["swiglu"] == "reference"
    no_triton = choose_kernels(settings, "cuda", available(triton="no triton"))
    assert no_triton.chosen["swiglu"] == "reference"  # inductor on CUDA needs Triton
    with pytest.raises(ConfigError, match="compile_ops names unknown ops"):
        choose_kernels(KernelSettings(compile_ops=("softmaxx",)), "cuda", available())


def test_transformer_engine_forced_without_te_is_one_line_naming_flag_and_what_is_missing() -> None:
    settings = KernelSettings(transformer_impl="transformer_engine")
    reason = "import transformer_engine.pytorch failed: ModuleNotFoundError: No module named 'x'"
    with pytest.raises(ConfigError) as error:
        choose_kernels(settings, "cuda", available(te=reason))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--transformer-impl transformer_engine: ")
    assert reason in message
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine: .*CUDA.*cpu"):
        choose_kernels(settings, "cpu", available())
    with pytest.raises(ConfigError, match="--transformer-impl"):
        choose_kernels(KernelSettings(transformer_impl="te"), "cpu")


def test_settings_from_a_config_or_namespace_and_unknown_ops() -> None:
    args = argparse.Namespace(bias_gelu_fusion=False, transformer_impl="local", lr=1e-3)
    settings = KernelSettings.from_object(args)
    assert settings == KernelSettings(bias_gelu_fusion=False)
    config = KernelConfig(
        attention_backend="flash", rope_fusion=False, cross_entropy_loss_fusion=True
    )
    expected = KernelSettings(
        attention_backend="flash", rope_fusion=False, cross_entropy_loss_fusion=True
    )
    assert KernelSettings.from_object(config) == expected
    with pytest.raises(KeyError, match="no kernel op 'gelu'"):
        choose_kernels(settings, "cpu").op("gelu")


def test_probes_on_this_machine_never_raise_and_give_reasons() -> None:
    found = availability.detect()
    for probe in (found.triton, found.apex, found.te, found.flash_attn):
        assert isinstance(probe.available, bool) and probe.reason
    cpu_only = availability.triton_probe(environ={})
    if not torch.cuda.is_available():
        assert cpu_only == Probe(
            False, "Triton needs a CUDA device (or TRITON_INTERPRET=1 in tests)"
        )
        assert not found.apex.available and "CUDA" in found.apex.reason
        assert not found.te.available and "CUDA" in found.te.reason


def test_triton_probe_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    probe = availability.triton_probe(environ={"TRITON_INTERPRET": "1"})
    assert probe.available, probe.reason


@pytest.mark.parametrize(
    "failure", ["raise RuntimeError('CUDA ext broken')", "raise SystemExit(3)"]
)
def test_a_module_that_fails_in_any_way_is_unavailable_not_an_error(
    failure, tmp_path, monkeypatch
) -> None:
    (tmp_path / "broken_accelerator.py").write_text(failure + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    error = availability._import_error("broken_accelerator")
    assert error is not None and error.startswith("import broken_accelerator failed: ")
    assert "\n" not in error
    assert availability._import_error("json") is None


@pytest.mark.slow
def test_importing_the_dispatch_imports_no_accelerator_library() -> None:
    code = (
        "import sys, megapipe.kernels.dispatch\n"
        "names = ('triton', 'torch._dynamo', 'apex', 'transformer_engine', 'flash_attn')\n"
        "loaded = [m for m in names if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
