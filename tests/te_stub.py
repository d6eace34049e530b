"""A plain-torch stand-in for TransformerEngine at one rank, for CPU tests of megapipe's TE
wiring (tests/test_transformer_engine.py, tests/test_te_microbatches.py): TE's documented
Linear / LayerNormLinear contract (including `is_first_microbatch`), its DelayedScaling recipe
fields and its autocast, recording what a forward runs under."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types

import pytest
import torch
import torch.nn.functional as F


class StubLinear(torch.nn.Module):
    """TE's documented Linear at one rank: y = x W^T + b; return_bias hands b back (an empty
    tensor without bias, as TE does)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        sequence_parallel,
        tp_size,
        params_dtype,
        parallel_mode,
        return_bias,
        tp_group,
        init_method,
        device,
    ):
        super().__init__()
        assert tp_size == 1 and tp_group is None and not sequence_parallel
        assert parallel_mode in ("column", "row") and device == "cuda"
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        self.return_bias = return_bias

    def _linear(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = F.linear(x, self.weight, None if self.return_bias else self.bias)
        if not self.return_bias:
            return out
        return out, self.bias if self.bias is not None else torch.empty(0)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None):
        TE_FORWARDS.append((self, is_first_microbatch, ACTIVE_AUTOCASTS[0] > 0))
        return self._linear(x)


class StubLayerNormLinear(StubLinear):
    """TE's documented LayerNormLinear at one rank: the norm, then the Linear."""

    def __init__(self, in_features, out_features, *, normalization, eps, **kwargs) -> None:
        super().__init__(in_features, out_features, **kwargs)
        self.normalization, self.eps = normalization, eps
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features))

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None):
        TE_FORWARDS.append((self, is_first_microbatch, ACTIVE_AUTOCASTS[0] > 0))
        shape = (x.shape[-1],)
        if self.normalization == "LayerNorm":
            x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        else:
            x = F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
        return self._linear(x)


class StubFormat(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclasses.dataclass
class StubDelayedScaling:
    """TE's documented DelayedScaling fields (reduce_amax: TE >= 1.x)."""

    margin: int = 0
    fp8_format: StubFormat = StubFormat.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


AUTOCASTS: list[tuple] = []  # (recipe, group) of each autocast a forward runs under
# (module, is_first_microbatch, under an autocast) of each TE module's forward
TE_FORWARDS: list[tuple] = []
ACTIVE_AUTOCASTS = [0]  # how many stub autocasts are entered now


@contextlib.contextmanager
def stub_autocast(enabled, recipe, amax_reduction_group):
    assert enabled
    AUTOCASTS.append((recipe, amax_reduction_group))
    ACTIVE_AUTOCASTS[0] += 1
    try:
        yield
    finally:
        ACTIVE_AUTOCASTS[0] -= 1


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put the stand-in `transformer_engine` package in sys.modules (undone with the test's
    monkeypatch) and clear the records."""
    package = types.ModuleType("transformer_engine")
    module = types.ModuleType("transformer_engine.pytorch")
    module.Linear, module.LayerNormLinear = StubLinear, StubLayerNormLinear
    module.autocast = stub_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = StubFormat, StubDelayedScaling
    package.pytorch, package.common, common.recipe = module, common, recipe
    for name, value in (("transformer_engine", package), ("transformer_engine.pytorch", module),
                        ("transformer_engine.common", common),
                        ("transformer_engine.common.recipe", recipe)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, value)
    AUTOCASTS.clear()
    TE_FORWARDS.clear()
