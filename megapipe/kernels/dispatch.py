"""Which implementation of each fused op runs: decided once, from the settings, the device and
what is installed, then passed to the layers as a `KernelChoices` (no global switch).

The table. `IMPLEMENTATIONS` maps an op name to that op's own table, implementation name ->
callable, which each op module defines as `IMPLEMENTATIONS` beside its reference:

    IMPLEMENTATIONS = {
        "bias_gelu": {"reference": bias_gelu_reference, "triton": ..., "compile": ...},
        "layer_norm": {"reference": ..., "triton": ..., "apex": ..., "te": ...},  # and so on
    }

Rules for an op module (megapipe/kernels/<op>.py) that adds a row:
- every callable of a row has the reference's signature (keyword-only extras allowed);
- "reference" (plain torch, autograd through it) is always there: it is the specification;
- implementation names are those of `PREFERENCE`: "te", "apex", "triton", "compile",
  "reference"; each needs the library `REQUIRES` names (the norms' apex and te rows may also
  check more when called);
- importing the module must not import Triton, apex or TE: a row's callable imports its
  backend on first call (Triton's import alone takes seconds, and CPU runs never need it);
  the Triton kernels live in megapipe/kernels/triton_ops/<op>.py for that reason;
- an op with a Megatron switch names it in `FUSION_SWITCH` (ops without one always fuse).

The choice, per op: on CPU, the reference (Triton's interpreter is for tests only, far too
slow to train with). On CUDA, if the op's switch is off, the reference; else the first of
`PREFERENCE` that the op has and whose library is available, where "te" counts only with
transformer_impl="transformer_engine" and "compile" only for ops in `compile_ops` (where a
GPU measurement found torch.compile faster than the Triton kernel). A forced choice that
cannot run (transformer_engine without TransformerEngine) is a ConfigError naming the flag and
what is missing, as is --fp8-format without TE or on a GPU without FP8 tensor cores
(kernels/transformer_engine.py decides both).

Use, once per run, then hand `kernels` (or single ops) to the layers that need them:

    kernels = choose_kernels(KernelSettings.from_object(configs.kernels), device)
    print_rank_0(kernels.describe())       # kernels: bias_gelu=triton, layer_norm=apex, ...
    h = kernels.op("bias_gelu")(h, bias, "tanh")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch

from megapipe.config import KernelConfig
from megapipe.errors import ConfigError
from megapipe.kernels import (
    bias_dropout_add,
    bias_gelu,
    cross_entropy,
    layer_norm,
    rotary,
    softmax,
    swiglu,
)
from megapipe.kernels.availability import Availability, Probe, detect
from megapipe.kernels.transformer_engine import check_transformer_engine

Table = Mapping[str, Mapping[str, Callable[..., Any]]]

IMPLEMENTATIONS: Table = MappingProxyType(
    {
        "bias_gelu": MappingProxyType(bias_gelu.IMPLEMENTATIONS),
        "bias_dropout_add": MappingProxyType(bias_dropout_add.IMPLEMENTATIONS),
        "swiglu": MappingProxyType(swiglu.IMPLEMENTATIONS),
        "rotary": MappingProxyType(rotary.IMPLEMENTATIONS),
        "layer_norm": MappingProxyType(layer_norm.LAYER_NORM_IMPLEMENTATIONS),
        "rms_norm": MappingProxyType(layer_norm.RMS_NORM_IMPLEMENTATIONS),
        "masked_softmax": MappingProxyType(softmax.IMPLEMENTATIONS),
        "cross_entropy": MappingProxyType(cross_entropy.IMPLEMENTATIONS),
    }
)

PREFERENCE = ("te", "apex", "compile", "triton", "reference")
REQUIRES = {"te": "te", "apex": "apex", "compile": "triton", "triton": "triton"}

# op -> (KernelSettings field, the Megatron flag that turns the fusion off or on)
FUSION_SWITCH = {
    "bias_gelu": ("bias_gelu_fusion", "--no-bias-gelu-fusion"),
    "bias_dropout_add": ("bias_dropout_fusion", "--no-bias-dropout-fusion"),
    "swiglu": ("bias_swiglu_fusion", "--no-bias-swiglu-fusion"),
    "rotary": ("rope_fusion", "--no-rope-fusion"),
    "masked_softmax": ("masked_softmax_fusion", "--no-masked-softmax-fusion"),
    "cross_entropy": ("cross_entropy_loss_fusion", "--cross-entropy-loss-fusion"),
}
TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(frozen=True)
class KernelSettings(KernelConfig):
    """What the flags allow (`config.KernelConfig`: Megatron's switches and defaults) plus
    `compile_ops`; the device and the installed libraries decide the rest. persist_layer_norm
    picks between apex's persistent and plain fused norm kernels inside the norm ops; it does
    not change which library runs."""

    compile_ops: tuple[str, ...] = ()  # ops to run under torch.compile instead of Triton

    @classmethod
    def from_object(cls, source: Any) -> KernelSettings:
        """The fields of the same names from a config or argparse namespace (others default)."""
        names = [f.name for f in fields(cls) if hasattr(source, f.name)]
        values = {name: getattr(source, name) for name in names}
        if "compile_ops" in values:
            values["compile_ops"] = tuple(values["compile_ops"])
        return cls(**values)


@dataclass(frozen=True)
class KernelChoices:
    """The chosen implementation of each op, why, and the callables themselves."""

    device_type: str
    chosen: Mapping[str, str]  # op -> implementation name
    reasons: Mapping[str, str]  # op -> why that one (the unavailable better ones, or a flag)
    table: Table  # the IMPLEMENTATIONS table the choice was made from

    def op(self, name: str) -> Callable[..., Any]:
        """The callable that runs op `name`."""
        if name not in self.chosen:
            raise KeyError(f"no kernel op {name!r}; known: {', '.join(self.chosen)}")
        return self.table[name][self.chosen[name]]

    def describe(self) -> str:
        """The start-up line rank 0 prints: `kernels: bias_gelu=triton, layer_norm=apex, ...`."""
        return "kernels: " + ", ".join(f"{op}={impl}" for op, impl in self.chosen.items())


def _check_settings(settings: KernelSettings, table: Table) -> None:
    if settings.transformer_impl not in TRANSFORMER_IMPLS:
        raise ConfigError(
            f"--transformer-impl {settings.transformer_impl}: expected one of "
            f"{', '.join(TRANSFORMER_IMPLS)}"
        )
    unknown = [op for op in settings.compile_ops if op not in table]
    if unknown:
        raise ConfigError(f"compile_ops names unknown ops {unknown}; known: {', '.join(table)}")


def _choose_one(
    op: str, impls: Mapping[str, Callable[..., Any]], settings: KernelSettings, avail: Availability
) -> tuple[str, str]:
    """(implementation, reason) for one op on CUDA."""
    switch = FUSION_SWITCH.get(op)
    if switch is not None and not getattr(settings, switch[0]):
        return "reference", f"fusion off ({switch[1]})"
    skipped = []
    for impl in PREFERENCE:
        if impl not in impls:
            continue
        if impl == "te" and settings.transformer_impl != "transformer_engine":
            continue
        if impl == "compile" and op not in settings.compile_ops:
            continue
        if impl == "reference":
            break
        probe = getattr(avail, REQUIRES[impl])
        if probe.available:
            return impl, probe.reason
        skipped.append(f"{impl}: {probe.reason}")
    return "reference", "; ".join(skipped) or "no fused implementation"


def choose_kernels(
    settings: KernelSettings,
    device: torch.device | str,
    available: Availability | None = None,
    table: Table = IMPLEMENTATIONS,
    capability: tuple[int, int] | None = None,
) -> KernelChoices:
    """Decide every op's implementation for `device`. available: what is installed (probed
    with `availability.detect()` when None and the device is CUDA; tests pass it in).
    capability: the CUDA device's compute capability for the FP8 check (read from the device
    when None and --fp8-format is set; tests pass it in)."""
    _check_settings(settings, table)
    device = torch.device(device)
    if device.type == "cuda" and available is None:
        available = detect()
    if device.type == "cuda" and capability is None and settings.fp8_format is not None:
        capability = torch.cuda.get_device_capability(device)
    te = available.te if available is not None else Probe(False, "not probed off CUDA")
    check_transformer_engine(
        settings.transformer_impl,
        settings.fp8_format,
        te=te,
        device_type=device.type,
        capability=capability,
    )
    chosen, reasons = {}, {}
    for op, impls in table.items():
        if "reference" not in impls:
            raise ConfigError(f"kernel op {op!r} has no reference implementation")
        if device.type == "cuda":
            chosen[op], reasons[op] = _choose_one(op, impls, settings, available)
        else:
            chosen[op], reasons[op] = "reference", f"{device.type}: plain torch"
    return KernelChoices(
        device.type, MappingProxyType(chosen), MappingProxyType(reasons), MappingProxyType(table)
    )
