"""Hugging Face import: a transformers `GPT2LMHeadModel`, `LlamaForCausalLM` or
`MixtralForCausalLM` (`hf_mixtral`) directory
(`config.json` + one safetensors file or a sharded index) -> a megapipe checkpoint at any layout.

`config.json` gives the ModelConfig (validated as flags are); a config with no megapipe
equivalent (another model_type or architecture, an activation, rope scaling or attention
option megapipe lacks) is refused by name. Every tensor is then checked against the shapes
those sizes need before anything is written: a missing tensor, one of another shape, or one
megapipe would not use (beyond transformers' own buffers and a tied output layer equal to the
embedding) is named in one line. The tensors are mapped to megapipe's logical names (the
inverse of `hf_export`) and written through convert's writing path, at iteration 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import fields

import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.hf_safetensors import read_weights
from megapipe.checkpointing.run_state import Progress
from megapipe.config import ModelConfig
from megapipe.conversion.convert import Say, Source, write_source
from megapipe.conversion.hf_export import (
    EXACT_GELUS,
    FC1,
    FC1_B,
    FC2,
    FC2_B,
    FINAL,
    FINAL_B,
    LN1,
    LN1_B,
    LN2,
    LN2_B,
    OUTPUT,
    POS,
    PROJ,
    PROJ_B,
    QKV,
    QKV_B,
    TANH_GELUS,
    WORD,
    join_qkv,
)
from megapipe.conversion.hf_mixtral import import_moe_tensors, moe_from_hf, moe_shapes
from megapipe.errors import ConfigError

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
EMBEDDING = {
    "gpt2": "transformer.wte.weight",
    "llama": "model.embed_tokens.weight",
    "mixtral": "model.embed_tokens.weight",
}
# transformers' non-persistent buffers that older versions saved: recomputed, never weights
BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _model_config(hf: dict, directory: str) -> ModelConfig:
    kind = hf.get("model_type")
    architectures = hf.get("architectures") or [ARCHITECTURES.get(kind)]
    if kind in ARCHITECTURES and architectures != [ARCHITECTURES[kind]]:
        raise ConfigError(
            f"{directory}: architectures {architectures}: megapipe imports "
            f"{ARCHITECTURES[kind]} (a causal LM with its output layer)"
        )
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in TANH_GELUS + EXACT_GELUS:
            raise ConfigError(
                f"{directory}: GPT-2 activation_function {act!r}: megapipe has the exact GeLU "
                f"({', '.join(EXACT_GELUS)}) and the tanh one ({', '.join(TANH_GELUS)})"
            )
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ConfigError(f"{directory}: GPT-2 attention scaling options megapipe lacks")
        if hf.get("tie_word_embeddings", True) is False:
            raise ConfigError(f"{directory}: untied GPT-2 output layer is not supported")
        h = hf["n_embd"]
        return ModelConfig(
            num_layers=hf["n_layer"],
            hidden_size=h,
            num_attention_heads=hf["n_head"],
            vocab_size=hf["vocab_size"],
            seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            ffn_hidden_size=hf.get("n_inner") or 4 * h,
            layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            openai_gelu=act in TANH_GELUS,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    if kind in ("llama", "mixtral"):
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{directory}: {kind} hidden_act {hf['hidden_act']!r}: not SwiGLU")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"{directory}: rope scaling {rope!r}: megapipe has plain rotary")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise ConfigError(f"{directory}: rope_theta {theta} is not an integer --rotary-base")
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or h // heads
        kv_channels = None if head_dim * heads == h else head_dim  # --kv-channels
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise ConfigError(
                f"{directory}: partial_rotary_factor {partial}: Llama rotates whole heads"
            )
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            raise ConfigError(f"{directory}: attention_bias != mlp_bias (one --add-bias-linear)")
        groups = hf.get("num_key_value_heads") or heads
        return ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=h,
            num_attention_heads=heads,
            vocab_size=hf["vocab_size"],
            seq_length=hf["max_position_embeddings"],
            max_position_embeddings=hf["max_position_embeddings"],
            ffn_hidden_size=hf["intermediate_size"],
            num_query_groups=groups,
            kv_channels=kv_channels,
            position_embedding_type="rope",
            rotary_base=int(theta),
            normalization="RMSNorm",
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            add_bias_linear=bool(hf.get("attention_bias", False)),
            attention_dropout=0.0,
            hidden_dropout=0.0,
            moe=moe_from_hf(hf, directory) if kind == "mixtral" else None,
        )
    raise ConfigError(
        f"{directory}: model_type {kind!r} ({hf.get('architectures')}): only gpt2, llama and "
        "mixtral import"
    )


def expected_shapes(config: ModelConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """Every weight a transformers directory of `config` holds, by name, with its shape."""
    h, v, f = config.hidden_size, config.vocab_size, config.ffn_hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_query_groups * config.head_dim
    if kind == "gpt2":
        shapes = {
            "transformer.wte.weight": (v, h),
            "transformer.wpe.weight": (config.max_position_embeddings, h),
            "transformer.ln_f.weight": (h,),
            "transformer.ln_f.bias": (h,),
        }
        prefix = "transformer.h."
        layer = {f"{n}.{p}": (h,) for n in ("ln_1", "ln_2") for p in ("weight", "bias")}
        linears = {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h)}
        linears |= {"mlp.c_fc": (h, f), "mlp.c_proj": (f, h)}  # Conv1D: [in, out]
        bias = 1  # a bias of [out]
    else:
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if config.untie_embeddings_and_output_weights:
            shapes["lm_head.weight"] = (v, h)
        prefix = "model.layers."
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        linears = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h)}
        linears |= {"self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q)}
        if config.moe is None:
            linears |= {"mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
        else:
            layer |= moe_shapes(config)
        bias = 0 if config.add_bias_linear else None  # nn.Linear: [out, in]
    for name, shape in linears.items():
        layer[name + ".weight"] = shape
        if bias is not None:
            layer[name + ".bias"] = (shape[bias],)
    for i in range(config.num_layers):
        shapes.update({f"{prefix}{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_tensors(hf: dict[str, torch.Tensor], config: ModelConfig, kind: str, where: str) -> None:
    """CheckpointError naming the first tensor that is missing, has a shape `config` does not
    give, or has no place in megapipe's model."""
    shapes = expected_shapes(config, kind)
    missing = [name for name in shapes if name not in hf]
    if missing:
        more = f" ({len(missing)} missing in all)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: tensor {missing[0]} is missing{more}")
    for name, shape in shapes.items():
        if tuple(hf[name].shape) != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {tuple(hf[name].shape)}, config.json's sizes "
                f"need {shape}"
            )
    extra = sorted(n for n in set(hf) - set(shapes) if not n.endswith(BUFFERS))
    if extra == ["lm_head.weight"] and torch.equal(hf["lm_head.weight"], hf[EMBEDDING[kind]]):
        return  # a tied output layer saved as a copy of the embedding
    if "lm_head.weight" in extra:
        raise CheckpointError(
            f"{where}: tensor lm_head.weight differs from {EMBEDDING[kind]}, but config.json "
            "ties them (tie_word_embeddings)"
        )
    if extra:
        more = f" ({len(extra)} such tensors)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{where}: tensor {extra[0]} has no place in megapipe's {ARCHITECTURES[kind]}{more}"
        )


def _stack(get, names: list[str]) -> torch.Tensor:
    return torch.stack([get(n) for n in names])


def _megapipe_tensors(
    hf: dict[str, torch.Tensor], config: ModelConfig, kind: str
) -> dict[str, torch.Tensor]:
    """megapipe's logical tensors from transformers' (already checked by `check_tensors`)."""
    get = hf.__getitem__
    n = config.num_layers
    t: dict[str, torch.Tensor] = {}
    if kind == "gpt2":

        def per(suffix: str) -> list[str]:
            return [f"transformer.h.{i}.{suffix}" for i in range(n)]

        def qkv(suffix: str, transpose: bool) -> torch.Tensor:
            rows = []
            for name in per(suffix):
                w = get(name).t() if transpose else get(name)
                rows.append(join_qkv(*w.chunk(3), config))
            return torch.stack(rows)

        t[WORD], t[POS] = get("transformer.wte.weight"), get("transformer.wpe.weight")
        t[FINAL], t[FINAL_B] = get("transformer.ln_f.weight"), get("transformer.ln_f.bias")
        t[LN1], t[LN1_B] = _stack(get, per("ln_1.weight")), _stack(get, per("ln_1.bias"))
        t[LN2], t[LN2_B] = _stack(get, per("ln_2.weight")), _stack(get, per("ln_2.bias"))
        t[QKV], t[QKV_B] = qkv("attn.c_attn.weight", True), qkv("attn.c_attn.bias", False)
        linears = (
            (PROJ, PROJ_B, "attn.c_proj"),
            (FC1, FC1_B, "mlp.c_fc"),
            (FC2, FC2_B, "mlp.c_proj"),
        )
        for key, bias, name in linears:
            t[key] = torch.stack([get(x).t() for x in per(name + ".weight")])
            t[bias] = _stack(get, per(name + ".bias"))
    else:

        def per(suffix: str) -> list[str]:
            return [f"model.layers.{i}.{suffix}" for i in range(n)]

        def qkv(kind: str) -> torch.Tensor:
            rows = []
            for i in range(n):
                p = f"model.layers.{i}.self_attn."
                parts = [get(p + x + "_proj." + kind) for x in "qkv"]
                rows.append(join_qkv(*parts, config))
            return torch.stack(rows)

        def fc1(kind: str) -> torch.Tensor:
            return torch.stack(
                [
                    torch.cat([get(g), get(u)])
                    for g, u in zip(per("mlp.gate_proj." + kind), per("mlp.up_proj." + kind))
                ]
            )

        t[WORD], t[FINAL] = get("model.embed_tokens.weight"), get("model.norm.weight")
        if config.untie_embeddings_and_output_weights:
            t[OUTPUT] = get("lm_head.weight")
        t[LN1] = _stack(get, per("input_layernorm.weight"))
        t[LN2] = _stack(get, per("post_attention_layernorm.weight"))
        t[QKV] = qkv("weight")
        t[PROJ] = _stack(get, per("self_attn.o_proj.weight"))
        if config.moe is not None:  # Mixtral: no dense MLP, no biases
            t.update(import_moe_tensors(hf, config))
            return {k: v.contiguous() for k, v in t.items()}
        t[FC1], t[FC2] = fc1("weight"), _stack(get, per("mlp.down_proj.weight"))
        if config.add_bias_linear:
            t[QKV_B], t[FC1_B] = qkv("bias"), fc1("bias")
            t[PROJ_B] = _stack(get, per("self_attn.o_proj.bias"))
            t[FC2_B] = _stack(get, per("mlp.down_proj.bias"))
    return {k: v.contiguous() for k, v in t.items()}


def config_args(config: ModelConfig) -> dict[str, str]:
    """Saved-argument entries (repr strings, as a run saves them) for a ModelConfig."""
    args = {f.name: repr(getattr(config, f.name)) for f in fields(ModelConfig) if f.name != "moe"}
    args["group_query_attention"] = repr(config.num_query_groups != config.num_attention_heads)
    moe = config.moe
    args["num_experts"] = repr(None if moe is None else moe.num_experts)
    if moe is not None:  # the MoE flags (MoEConfig's fields are their names)
        args.update({f.name: repr(getattr(moe, f.name)) for f in fields(moe)})
    return args


Validate = Callable[[ModelConfig], None]  # megapipe.arguments.validation.validate_model


def read_config(directory: str, validate: Validate) -> tuple[dict, ModelConfig]:
    """The config.json of a transformers directory, and the ModelConfig it describes, checked
    by `validate` (the flags' own check, passed in: arguments sits above checkpointing)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"--load-dir {directory}: no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except ValueError as error:
        raise CheckpointError(f"{path}: not JSON ({error})") from None
    try:
        config = _model_config(hf, directory)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path}: lacks or mistypes {error}") from None
    try:
        validate(config)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    return hf, config


def read_hf(directory: str, validate: Validate) -> Source:
    """A transformers GPT-2, Llama or Mixtral directory as a megapipe `Source`."""
    hf, config = read_config(directory, validate)
    weights = read_weights(directory)
    check_tensors(weights, config, hf["model_type"], directory)
    tensors = _megapipe_tensors(weights, config, hf["model_type"])
    return Source(directory, "hf", tensors, config_args(config), Progress(), config)


def import_hf(
    load_dir: str,
    save_dir: str,
    tp: int = 1,
    pp: int = 1,
    fmt: str = "torch_dist",
    say: Say = print,
    *,
    validate: Validate,
) -> str:
    """Import transformers directory `load_dir` as a megapipe checkpoint (iteration 0);
    `validate` checks the model it describes (pass `arguments.validation.validate_model`)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir}: no such directory")
    return write_source(read_hf(load_dir, validate), save_dir, tp, pp, fmt, 0, say)
