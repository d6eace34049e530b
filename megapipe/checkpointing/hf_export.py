"""Hugging Face export and import: megapipe checkpoints <-> `config.json` + `model.safetensors`.

Export reads a checkpoint of any layout and format (`convert.read_source`: full logical tensors,
vocabulary padding removed) and writes the tensors under transformers' names:

- learned positions, LayerNorm, biases, GeLU, tied embeddings -> `GPT2LMHeadModel` (`Conv1D`
  weights transposed to [in, out], `c_attn` as [q | k | v] split from megapipe's per-group
  QKV; megapipe's GeLU is the exact erf one, so `activation_function` is "gelu", not GPT-2's
  default tanh "gelu_new");
- rotary, RMSNorm, SwiGLU (GQA, biases or not, tied or untied) -> `LlamaForCausalLM`
  (separate q/k/v/o and gate/up/down projections; rotate-half rotary, as megapipe's).

A flag combination with no transformers equivalent is refused with a ConfigError naming it.
Import reads such a directory (one safetensors file or a sharded index) back into a `Source`
and writes a megapipe checkpoint at a target layout, through convert's writing path. The
export writes no tokenizer files and never shards the safetensors file.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields

import torch

from megapipe.checkpointing.convert import Say, Source, read_source, resolve, write_source
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.hf_tokenizer import write_tokenizer_files
from megapipe.checkpointing.run_state import Progress
from megapipe.config import ModelConfig
from megapipe.errors import ConfigError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
L = "decoder.layers."
QKV, QKV_B = L + "self_attention.linear_qkv.weight", L + "self_attention.linear_qkv.bias"
PROJ, PROJ_B = L + "self_attention.linear_proj.weight", L + "self_attention.linear_proj.bias"
FC1, FC1_B = L + "mlp.linear_fc1.weight", L + "mlp.linear_fc1.bias"
FC2, FC2_B = L + "mlp.linear_fc2.weight", L + "mlp.linear_fc2.bias"
LN1 = L + "self_attention.linear_qkv.layer_norm_weight"
LN1_B = L + "self_attention.linear_qkv.layer_norm_bias"
LN2, LN2_B = L + "mlp.linear_fc1.layer_norm_weight", L + "mlp.linear_fc1.layer_norm_bias"
FINAL, FINAL_B = "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"
WORD, POS = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
# transformers' GPT-2 activation_function names: the tanh formula 0.5x(1 + tanh(sqrt(2/pi)(x +
# 0.044715x^3))) written five ways (equal up to fp32 rounding), and the exact erf GeLU two ways.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
EXACT_GELUS = ("gelu", "gelu_python")


def _refuse(what: str, why: str) -> None:
    raise ConfigError(f"{what} has no Hugging Face equivalent: {why}")


def architecture(config: ModelConfig) -> str:
    """ "gpt2" or "llama" for this model; ConfigError naming the flags that fit neither."""
    if config.position_embedding_type == "learned_absolute":
        arch = "GPT2LMHeadModel (the architecture of learned positions)"
        if config.normalization != "LayerNorm":
            what = f"--normalization {config.normalization} with learned positions"
            _refuse(what, arch + " uses LayerNorm")
        if config.swiglu:
            _refuse("--swiglu with learned positions", arch + " uses a GeLU MLP")
        if not config.add_bias_linear:
            _refuse("--disable-bias-linear with learned positions", arch + " has biases")
        if config.untie_embeddings_and_output_weights:
            what = "--untie-embeddings-and-output-weights with learned positions"
            _refuse(what, arch + " ties them")
        if config.num_query_groups != config.num_attention_heads:
            _refuse("--group-query-attention with learned positions", arch + " has no GQA")
        return "gpt2"
    if config.position_embedding_type == "rope":
        arch = "LlamaForCausalLM (the architecture of rotary positions)"
        if config.normalization != "RMSNorm":
            what = f"--normalization {config.normalization} with rotary positions"
            _refuse(what, arch + " uses RMSNorm")
        if not config.swiglu:
            _refuse("rotary positions without --swiglu", arch + " uses SwiGLU")
        return "llama"
    _refuse(
        f"--position-embedding-type {config.position_embedding_type}",
        "GPT-2 has learned positions, Llama rotary ones",
    )
    raise AssertionError


def _split_qkv(w: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    """megapipe's [group: q_0..q_{k-1}, k, v]* rows -> (q, k, v) rows (w: [rows] or [rows, h])."""
    groups, d = config.num_query_groups, config.head_dim
    per = config.num_attention_heads // groups
    g = w.reshape(groups, per + 2, d, *w.shape[1:])
    q = g[:, :per].reshape(groups * per * d, *w.shape[1:])
    k = g[:, per].reshape(groups * d, *w.shape[1:])
    v = g[:, per + 1].reshape(groups * d, *w.shape[1:])
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig):
    groups, d = config.num_query_groups, config.head_dim
    per = config.num_attention_heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per, d, *rest)
    kg, vg = k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _gpt2_tensors(t: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {
        "transformer.wte.weight": t[WORD],
        "transformer.wpe.weight": t[POS],
        "transformer.ln_f.weight": t[FINAL],
        "transformer.ln_f.bias": t[FINAL_B],
    }
    for i in range(config.num_layers):
        p = f"transformer.h.{i}."
        out[p + "ln_1.weight"], out[p + "ln_1.bias"] = t[LN1][i], t[LN1_B][i]
        out[p + "ln_2.weight"], out[p + "ln_2.bias"] = t[LN2][i], t[LN2_B][i]
        out[p + "attn.c_attn.weight"] = torch.cat(_split_qkv(t[QKV][i], config)).t()
        out[p + "attn.c_attn.bias"] = torch.cat(_split_qkv(t[QKV_B][i], config))
        out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = t[PROJ][i].t(), t[PROJ_B][i]
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = t[FC1][i].t(), t[FC1_B][i]
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = t[FC2][i].t(), t[FC2_B][i]
    return out


def _llama_tensors(t: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": t[WORD], "model.norm.weight": t[FINAL]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t[OUTPUT]
    bias = config.add_bias_linear
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = t[LN1][i]
        out[p + "post_attention_layernorm.weight"] = t[LN2][i]
        for kind, (qkv, proj, fc1, fc2) in {
            "weight": (QKV, PROJ, FC1, FC2),
            "bias": (QKV_B, PROJ_B, FC1_B, FC2_B),
        }.items():
            if kind == "bias" and not bias:
                continue
            q, k, v = _split_qkv(t[qkv][i], config)
            out[f"{p}self_attn.q_proj.{kind}"], out[f"{p}self_attn.k_proj.{kind}"] = q, k
            out[f"{p}self_attn.v_proj.{kind}"] = v
            out[f"{p}self_attn.o_proj.{kind}"] = t[proj][i]
            gate, up = t[fc1][i].chunk(2)
            out[f"{p}mlp.gate_proj.{kind}"], out[f"{p}mlp.up_proj.{kind}"] = gate, up
            out[f"{p}mlp.down_proj.{kind}"] = t[fc2][i]
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json of the transformers model equal to `config`."""
    arch = architecture(config)
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.max_position_embeddings,
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "activation_function": "gelu_new" if config.openai_gelu else "gelu",
            "layer_norm_epsilon": config.layernorm_epsilon,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
            "bos_token_id": None,  # GPT-2's 50256 is outside a smaller vocabulary
            "eos_token_id": None,
            "torch_dtype": _dtype_name(dtype),
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": float(config.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base)},
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": 0.0,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "torch_dtype": _dtype_name(dtype),
    }


def export_source(source: Source, save_dir: str, say: Say = print) -> str:
    """Write `source` as a transformers directory; returns it."""
    from safetensors.torch import save_file

    config = source.config
    arch = architecture(config)
    convert = _gpt2_tensors if arch == "gpt2" else _llama_tensors
    try:
        tensors = convert(source.tensors, config)
    except KeyError as error:
        raise CheckpointError(f"checkpoint {source.directory}: no tensor {error}") from None
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    os.makedirs(save_dir, exist_ok=True)
    dtype = source.tensors[WORD].dtype
    hf = hf_config(config, dtype)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_file(tensors, os.path.join(save_dir, WEIGHTS), metadata={"format": "pt"})
    say(f" wrote {save_dir} ({hf['architectures'][0]}, {len(tensors)} tensors)")
    write_tokenizer_files(source.args, save_dir, say)
    return save_dir


def export_hf(load_dir: str, save_dir: str, say: Say = print) -> str:
    """Export the latest checkpoint of megapipe `load_dir` to transformers directory `save_dir`."""
    directory, _ = resolve(load_dir)
    say(f" reading {directory}")
    return export_source(read_source(directory, say), save_dir, say)


# --- import -------------------------------------------------------------------------------


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise CheckpointError(f"--load-dir {directory}: no {WEIGHTS} or {INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _model_config(hf: dict, directory: str) -> ModelConfig:
    kind = hf.get("model_type")
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
    if kind == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{directory}: Llama hidden_act {hf['hidden_act']!r}: not SwiGLU")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"{directory}: rope scaling {rope!r}: megapipe has plain rotary")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise ConfigError(f"{directory}: rope_theta {theta} is not an integer --rotary-base")
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim", h // heads) != h // heads:
            raise ConfigError(f"{directory}: head_dim {hf['head_dim']} is not hidden/heads")
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
            position_embedding_type="rope",
            rotary_base=int(theta),
            normalization="RMSNorm",
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            add_bias_linear=bool(hf.get("attention_bias", False)),
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    raise ConfigError(
        f"{directory}: model_type {kind!r} ({hf.get('architectures')}): only gpt2 and llama import"
    )


def _stack(get, names: list[str]) -> torch.Tensor:
    return torch.stack([get(n) for n in names])


def _megapipe_tensors(hf: dict[str, torch.Tensor], config: ModelConfig, kind: str, where: str):
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"{where}: tensor {name} is missing")
        used.add(name)
        return hf[name]

    n = config.num_layers
    t: dict[str, torch.Tensor] = {}
    if kind == "gpt2":

        def per(suffix: str) -> list[str]:
            return [f"transformer.h.{i}.{suffix}" for i in range(n)]

        def qkv(suffix: str, transpose: bool) -> torch.Tensor:
            rows = []
            for name in per(suffix):
                w = get(name).t() if transpose else get(name)
                rows.append(_join_qkv(*w.chunk(3), config))
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
        ignored = {k for k in hf if k.endswith((".attn.bias", ".attn.masked_bias"))}
        ignored.add("lm_head.weight")  # tied: a copy of wte when present
    else:

        def per(suffix: str) -> list[str]:
            return [f"model.layers.{i}.{suffix}" for i in range(n)]

        def qkv(kind: str) -> torch.Tensor:
            rows = []
            for i in range(n):
                p = f"model.layers.{i}.self_attn."
                parts = [get(p + x + "_proj." + kind) for x in "qkv"]
                rows.append(_join_qkv(*parts, config))
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
        t[QKV], t[FC1] = qkv("weight"), fc1("weight")
        t[PROJ] = _stack(get, per("self_attn.o_proj.weight"))
        t[FC2] = _stack(get, per("mlp.down_proj.weight"))
        if config.add_bias_linear:
            t[QKV_B], t[FC1_B] = qkv("bias"), fc1("bias")
            t[PROJ_B] = _stack(get, per("self_attn.o_proj.bias"))
            t[FC2_B] = _stack(get, per("mlp.down_proj.bias"))
        ignored = set() if config.untie_embeddings_and_output_weights else {"lm_head.weight"}
        ignored |= {k for k in hf if k.endswith("rotary_emb.inv_freq")}
    extra = sorted(set(hf) - used - ignored)
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]} ({len(extra)} in all)")
    return {k: v.contiguous() for k, v in t.items()}


def config_args(config: ModelConfig) -> dict[str, str]:
    """Saved-argument entries (repr strings, as a run saves them) for a ModelConfig."""
    args = {f.name: repr(getattr(config, f.name)) for f in fields(ModelConfig)}
    args["group_query_attention"] = repr(config.num_query_groups != config.num_attention_heads)
    return args


def read_hf(directory: str) -> Source:
    """A transformers GPT-2 or Llama directory as a megapipe `Source`."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"--load-dir {directory}: no config.json")
    with open(path) as f:
        hf = json.load(f)
    config = _model_config(hf, directory)
    tensors = _megapipe_tensors(_read_weights(directory), config, hf["model_type"], directory)
    if tuple(tensors[WORD].shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(
            f"{directory}: word embedding shape {tuple(tensors[WORD].shape)} does not fit "
            f"vocab_size {config.vocab_size} x hidden {config.hidden_size}"
        )
    return Source(directory, "hf", tensors, config_args(config), Progress(), config)


def import_hf(
    load_dir: str,
    save_dir: str,
    tp: int = 1,
    pp: int = 1,
    fmt: str = "torch_dist",
    say: Say = print,
) -> str:
    """Import transformers directory `load_dir` as a megapipe checkpoint (iteration 0)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir}: no such directory")
    return write_source(read_hf(load_dir), save_dir, tp, pp, fmt, 0, say)
