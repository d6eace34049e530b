"""--transformer-impl transformer_engine: a transformer layer's linears (and the norms before
them) as TransformerEngine modules, tensor-parallel over megapipe's own process groups.

The layout is Megatron-Core's TE spec: the input norm fuses into the QKV projection and the
pre-MLP norm into fc1 (`LayerNormLinear`, column-parallel), the attention output projection
and fc2 are row-parallel `Linear`s. Everything between them stays megapipe's: the core
attention (SDPA / flash / unfused, rotary, GQA, --reset-attention-mask, the KV cache, the
layout-invariant dropout masks) and the activation (exact or tanh GeLU, SwiGLU, with the fused
kernels). That is why TE's `LayerNormMLP` / `TransformerLayer` are not used: TE's "gelu" is the
tanh approximation and its attention takes neither our masks nor our cache.

Two halves:
- `te_layer_specs` (pure, tested on CPU): which TE class each site gets and its constructor
  arguments, as plain data, plus which of megapipe's parameters each TE parameter stands for;
- `use_transformer_engine` (needs TE and CUDA): builds the modules from the specs and puts them
  in place of megapipe's in a built `TransformerLayer`. Each TE parameter takes the `ParamMeta`
  of the parameter it replaces, so initialisation from (seed, global name) gives the same
  weights as --transformer-impl local, and the SP gradient reduction, the grad norm and
  checkpoint resharding treat it alike.

Parameter names: the linears keep theirs (`self_attention.linear_qkv.weight`, ...); the norms
become TE's fused names, which are also Megatron-Core's: `input_layernorm.weight` ->
`self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm.*` ->
`mlp.linear_fc1.layer_norm_*`. `te_parameter_name` / `local_parameter_name` map between them
and `local_state_dict` turns a TE model's state dict into --transformer-impl local's, so
checkpoints interchange.

FP8 (--fp8-format): TE's autocast with the run's DelayedScaling recipe, amax reduced over the
TP group, is entered once per model chunk forward (`chunk_fp8_scope`, entered by the Decoder
around its layers; a TE module entered outside it, as in a recomputation during backward,
enters it itself). Each TE module is told `is_first_microbatch`: True on its first forward
after `start_microbatches` (called at the start of each training step and each evaluation),
False after, so TE casts the weights to fp8 once per step and reuses the cast for the other
micro-batches (and for recomputation).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from megapipe.config import KernelConfig, ModelConfig
from megapipe.errors import ConfigError
from megapipe.kernels.transformer_engine import (
    FP8Scope,
    fp8_autocast,
    fp8_recipe,
    fp8_recipe_kwargs,
)
from megapipe.parallel.state import Group

# The norm each LayerNormLinear absorbs: TE site -> megapipe norm module
FUSED_NORMS = {
    "self_attention.linear_qkv": "input_layernorm",
    "mlp.linear_fc1": "pre_mlp_layernorm",
}


@dataclass(frozen=True)
class TELinearSpec:
    """One TE module of a layer. te_class: "LayerNormLinear" or "Linear" (in
    transformer_engine.pytorch); kwargs: its constructor arguments except the process group,
    the init method and the device; params: TE parameter name -> the megapipe parameter it
    replaces (relative to the layer); init_std: of the weight; returns_bias: the forward hands
    the bias back instead of adding it (megapipe's skip_bias_add)."""

    site: str
    te_class: str
    kwargs: Mapping[str, Any]
    params: Mapping[str, str]
    init_std: float
    returns_bias: bool


def te_layer_specs(
    config: ModelConfig,
    tp_size: int,
    *,
    sequence_parallel: bool,
    output_init_std: float,
    fc1_skip_bias_add: bool,
    params_dtype: torch.dtype = torch.float32,
) -> dict[str, TELinearSpec]:
    """The four TE modules of one layer, site -> spec. fc1_skip_bias_add: megapipe's MLP
    takes fc1's bias into a fused activation kernel (so TE must hand it back)."""
    sp = sequence_parallel and tp_size > 1
    bias = config.add_bias_linear
    common = {
        "bias": bias,
        "sequence_parallel": sp,
        "tp_size": tp_size,
        "params_dtype": params_dtype,
    }
    qkv = config.head_dim * (config.num_attention_heads + 2 * config.num_query_groups)
    fc1 = config.ffn_hidden_size * (2 if config.swiglu else 1)

    def spec(site, in_features, out_features, mode, std, returns_bias) -> TELinearSpec:
        kwargs = dict(
            common,
            in_features=in_features,
            out_features=out_features,
            parallel_mode=mode,
            return_bias=returns_bias,
        )
        params = {"weight": f"{site}.weight"}
        if bias:
            params["bias"] = f"{site}.bias"
        te_class = "Linear"
        if site in FUSED_NORMS:
            te_class = "LayerNormLinear"
            kwargs.update(normalization=config.normalization, eps=config.layernorm_epsilon)
            norm = FUSED_NORMS[site]
            params["layer_norm_weight"] = f"{norm}.weight"
            if config.normalization == "LayerNorm":
                params["layer_norm_bias"] = f"{norm}.bias"
        return TELinearSpec(
            site, te_class, MappingProxyType(kwargs), MappingProxyType(params), std, returns_bias
        )

    h, std = config.hidden_size, config.init_method_std
    projection = config.num_attention_heads * config.head_dim
    specs = [
        spec("self_attention.linear_qkv", h, qkv, "column", std, False),
        spec("self_attention.linear_proj", projection, h, "row", output_init_std, True),
        spec("mlp.linear_fc1", h, fc1, "column", std, fc1_skip_bias_add),
        spec("mlp.linear_fc2", config.ffn_hidden_size, h, "row", output_init_std, True),
    ]
    return {s.site: s for s in specs}


def _name_pairs(config: ModelConfig) -> dict[str, str]:
    """Layer-relative megapipe name -> TE name, for the parameters whose names change."""
    specs = te_layer_specs(
        config, 1, sequence_parallel=False, output_init_std=1.0, fc1_skip_bias_add=False
    )
    return {
        local: f"{s.site}.{te_name}"
        for s in specs.values()
        for te_name, local in s.params.items()
        if local != f"{s.site}.{te_name}"
    }


def _rename(name: str, pairs: Mapping[str, str]) -> str:
    for old, new in pairs.items():
        if name == old or name.endswith("." + old):
            return name[: len(name) - len(old)] + new
    return name


def te_parameter_name(name: str, config: ModelConfig) -> str:
    """A megapipe (local) parameter name, global or layer-relative, as the TE model names it."""
    return _rename(name, _name_pairs(config))


def local_parameter_name(name: str, config: ModelConfig) -> str:
    """A TE model's parameter name as --transformer-impl local names it."""
    return _rename(name, {te: local for local, te in _name_pairs(config).items()})


def local_state_dict(state: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
    """A TE model's state dict under local names, without TE's `_extra_state` (FP8 scaling
    state) entries: loadable by --transformer-impl local."""
    return {
        local_parameter_name(k, config): v
        for k, v in state.items()
        if not k.endswith("._extra_state")
    }


def chunk_fp8_scope(kernels: KernelConfig | None, tp: Group) -> FP8Scope:
    """The FP8 autocast one model chunk enters around its layers: TE's, with the run's recipe
    (amax reduced over `tp` when it has more than one rank); a no-op scope without FP8 (no
    --fp8-format, or --transformer-impl local). Imports TransformerEngine only for FP8."""
    if kernels is None or kernels.transformer_impl != "transformer_engine":
        return FP8Scope(None)
    kwargs = fp8_recipe_kwargs(kernels)
    if kwargs is None:
        return FP8Scope(None)
    recipe = fp8_recipe(kwargs, reduce_amax=tp.size > 1)
    return FP8Scope(functools.partial(fp8_autocast, recipe, tp.pg))


def take_first_microbatch(module: torch.nn.Module) -> bool:
    """TE's `is_first_microbatch` for this forward of `module`: True once after each
    `start_microbatches`, then False (the weights have not changed since)."""
    first = module.megapipe_first_microbatch
    module.megapipe_first_microbatch = False
    return first


def start_microbatches(chunks: Iterable[torch.nn.Module]) -> int:
    """Mark every TE module of `chunks` so that its next forward recasts (and caches) its fp8
    weights: call where micro-batches over possibly new weights start (each training step,
    each evaluation). Returns how many modules were marked (0 without TE)."""
    marked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "megapipe_first_microbatch"):
                module.megapipe_first_microbatch = True
                marked += 1
    return marked


@functools.cache
def _adapter_class(te_class: type) -> type:
    """`te_class` with megapipe's linear interface: forward(x) -> (output, bias or None), with
    `is_first_microbatch` from its own flag, inside its chunk's FP8 scope (a no-op when the
    chunk already entered it). A subclass, not a wrapper, so the parameter names stay
    `linear_qkv.weight` (not `linear_qkv.module.weight`)."""

    class Adapter(te_class):
        megapipe_fp8_scope: FP8Scope = FP8Scope(None)
        megapipe_first_microbatch = True
        megapipe_returns_bias = False
        megapipe_has_bias = True

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            first = take_first_microbatch(self)
            with self.megapipe_fp8_scope():
                out = super().forward(x, is_first_microbatch=first)
            if not self.megapipe_returns_bias:
                return out, None
            out, bias = out
            return out, bias if self.megapipe_has_bias else None

    Adapter.__name__ = Adapter.__qualname__ = f"Megapipe{te_class.__name__}"
    return Adapter


def build_te_linear(spec: TELinearSpec, tp: Group, fp8_scope: FP8Scope) -> torch.nn.Module:
    """The TE module of `spec` on the current CUDA device (imports TransformerEngine)."""
    import transformer_engine.pytorch as te

    cls = _adapter_class(getattr(te, spec.te_class))
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=spec.init_std)
    module = cls(**spec.kwargs, tp_group=tp.pg, init_method=init, device="cuda")
    module.megapipe_fp8_scope = fp8_scope
    module.megapipe_returns_bias = spec.returns_bias
    module.megapipe_has_bias = bool(spec.kwargs["bias"])
    return module


def use_transformer_engine(
    layer: torch.nn.Module,
    config: ModelConfig,
    tp: Group,
    kernels: KernelConfig,
    *,
    sequence_parallel: bool,
    output_init_std: float,
    fp8_scope: FP8Scope | None = None,
) -> None:
    """Replace a built TransformerLayer's linears and norms by TE modules, in place; each TE
    parameter takes the ParamMeta of the megapipe parameter it replaces. fp8_scope: the
    chunk's (default: one of the layer's own, `chunk_fp8_scope`)."""
    if config.apply_residual_connection_post_layernorm:  # the fused norm's output is not kept
        raise ConfigError(
            "--apply-residual-connection-post-layernorm with --transformer-impl "
            "transformer_engine: TE fuses the norm into the QKV and fc1 linears, so its output "
            "is not there to add; use --transformer-impl local"
        )
    specs = te_layer_specs(
        config,
        tp.size,
        sequence_parallel=sequence_parallel,
        output_init_std=output_init_std,
        fc1_skip_bias_add=layer.mlp.linear_fc1.skip_bias_add,
    )
    if fp8_scope is None:
        fp8_scope = chunk_fp8_scope(kernels, tp)
    for spec in specs.values():
        module = build_te_linear(spec, tp, fp8_scope)
        for name, param in module.named_parameters():
            if name not in spec.params:
                raise RuntimeError(
                    f"TransformerEngine's {spec.te_class} has a parameter {name!r} megapipe "
                    f"does not map (known: {', '.join(spec.params)}); this TE version is not "
                    "supported"
                )
            param.meta = layer.get_parameter(spec.params[name]).meta
        parent, _, attribute = spec.site.rpartition(".")
        setattr(layer.get_submodule(parent), attribute, module)
    for norm in FUSED_NORMS.values():
        setattr(layer, norm, torch.nn.Identity())
