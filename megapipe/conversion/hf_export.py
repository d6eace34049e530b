"""Hugging Face export: a megapipe checkpoint of any layout -> a transformers directory that
`AutoModelForCausalLM.from_pretrained` loads (the way back is `hf_import`).

Export reads a checkpoint of any layout and format (`convert.read_source`: full logical tensors,
vocabulary padding removed) and writes the tensors under transformers' names:

- learned positions, LayerNorm, biases, GeLU, tied embeddings -> `GPT2LMHeadModel` (`Conv1D`
  weights transposed to [in, out], `c_attn` as [q | k | v] split from megapipe's per-group
  QKV; `activation_function` "gelu" for megapipe's exact erf GeLU, GPT-2's own "gelu_new" with
  --openai-gelu);
- rotary, RMSNorm, SwiGLU (GQA, biases or not, tied or untied) -> `LlamaForCausalLM`
  (separate q/k/v/o and gate/up/down projections; rotate-half rotary, as megapipe's);
- the same with --num-experts -> `MixtralForCausalLM` (`hf_mixtral`: the router and experts
  under `block_sparse_moe`).

A flag combination with no transformers equivalent is refused with a ConfigError naming it.
The directory holds `config.json`, the weights (`model.safetensors`, or shards with an index
above `max_shard_size`, 5GB by default: `hf_safetensors`) and the run's tokenizer files
(`hf_tokenizer`). It is written into a temporary sibling and renamed into place when complete,
so a crash or a refusal never leaves a directory that looks loadable.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from megapipe.atomic_files import fsync_path
from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.hf_safetensors import DEFAULT_MAX_SHARD_SIZE, parse_size, write_weights
from megapipe.checkpointing.hf_tokenizer import eod_id, write_tokenizer_files
from megapipe.checkpointing.tracker import RELEASE
from megapipe.config import ModelConfig
from megapipe.conversion.convert import Say, Source, resolve
from megapipe.conversion.hf_mixtral import check_mixtral, export_moe_tensors, hf_moe_fields
from megapipe.conversion.megatron_lm_source import read_any
from megapipe.errors import ConfigError

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
    """ "gpt2", "llama" or "mixtral" for this model; ConfigError naming the flags that fit
    none."""
    if config.qk_layernorm:
        _refuse("--qk-layernorm", "GPT-2 and Llama have no query/key norms")
    if config.squared_relu:
        _refuse("--squared-relu", "GPT-2's MLP uses GeLU, Llama's SwiGLU")
    if config.apply_residual_connection_post_layernorm:
        _refuse(
            "--apply-residual-connection-post-layernorm",
            "GPT-2 and Llama add the norm's input to the residual stream",
        )
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
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            what = f"--kv-channels {config.kv_channels} with learned positions"
            _refuse(what, arch + " has heads of hidden size / heads")
        if config.moe is not None:
            _refuse("--num-experts with learned positions", arch + " has no experts")
        return "gpt2"
    if config.position_embedding_type == "rope":
        arch = "LlamaForCausalLM (the architecture of rotary positions)"
        if config.normalization != "RMSNorm":
            what = f"--normalization {config.normalization} with rotary positions"
            _refuse(what, arch + " uses RMSNorm")
        if not config.swiglu:
            _refuse("rotary positions without --swiglu", arch + " uses SwiGLU")
        if config.rotary_percent != 1.0:
            what = f"--rotary-percent {config.rotary_percent}"
            _refuse(what, arch + " rotates whole heads")
        if config.moe is not None:
            check_mixtral(config)
            return "mixtral"
        return "llama"
    _refuse(
        f"--position-embedding-type {config.position_embedding_type}",
        "GPT-2 has learned positions, Llama rotary ones",
    )
    raise AssertionError


def split_qkv(w: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    """megapipe's [group: q_0..q_{k-1}, k, v]* rows -> (q, k, v) rows (w: [rows] or [rows, h])."""
    groups, d = config.num_query_groups, config.head_dim
    per = config.num_attention_heads // groups
    g = w.reshape(groups, per + 2, d, *w.shape[1:])
    q = g[:, :per].reshape(groups * per * d, *w.shape[1:])
    k = g[:, per].reshape(groups * d, *w.shape[1:])
    v = g[:, per + 1].reshape(groups * d, *w.shape[1:])
    return q, k, v


def join_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """The inverse of `split_qkv`: (q, k, v) rows -> megapipe's per-group QKV rows."""
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
        out[p + "attn.c_attn.weight"] = torch.cat(split_qkv(t[QKV][i], config)).t()
        out[p + "attn.c_attn.bias"] = torch.cat(split_qkv(t[QKV_B][i], config))
        out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = t[PROJ][i].t(), t[PROJ_B][i]
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = t[FC1][i].t(), t[FC1_B][i]
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = t[FC2][i].t(), t[FC2_B][i]
    return out


def _llama_tensors(t: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama's tensors, or Mixtral's (the MLPs replaced by `block_sparse_moe`)."""
    out = {"model.embed_tokens.weight": t[WORD], "model.norm.weight": t[FINAL]}
    moe = config.moe is not None
    if moe:
        out.update(export_moe_tensors(t, config))
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
            q, k, v = split_qkv(t[qkv][i], config)
            out[f"{p}self_attn.q_proj.{kind}"], out[f"{p}self_attn.k_proj.{kind}"] = q, k
            out[f"{p}self_attn.v_proj.{kind}"] = v
            out[f"{p}self_attn.o_proj.{kind}"] = t[proj][i]
            if moe:
                continue
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
    llama = {
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
    if arch == "mixtral":  # Llama's attention; no attention_bias / mlp_bias options
        del llama["attention_bias"], llama["mlp_bias"]
        llama.update(hf_moe_fields(config))
    return llama


def _check_replaceable(save_dir: str) -> None:
    """Refuse to replace a --save-dir that holds something other than a transformers model."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointError(f"--save-dir {save_dir}: exists and is not a directory")
    other = os.path.isdir(save_dir) and os.listdir(save_dir)
    if other and not os.path.exists(os.path.join(save_dir, "config.json")):
        raise CheckpointError(
            f"--save-dir {save_dir}: exists, not empty and not a Hugging Face directory "
            "(no config.json); not replacing it"
        )


def export_source(
    source: Source,
    save_dir: str,
    say: Say = print,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Write `source` as the transformers directory `save_dir` (replacing an earlier export
    there as a whole); returns it."""
    config = source.config
    arch = architecture(config)
    parse_size(max_shard_size)  # a bad size is refused before anything is written
    convert = _gpt2_tensors if arch == "gpt2" else _llama_tensors
    try:
        tensors = convert(source.tensors, config)
    except KeyError as error:
        raise CheckpointError(f"checkpoint {source.directory}: no tensor {error}") from None
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    hf = hf_config(config, source.tensors[WORD].dtype)
    eod = eod_id(source.args, config.vocab_size)
    if eod is not None:  # transformers' generate then stops where megapipe's does
        hf["eos_token_id"] = eod
        if arch == "gpt2":
            hf["bos_token_id"] = eod  # GPT-2's convention: <|endoftext|> is both
    save_dir = os.path.abspath(save_dir)
    _check_replaceable(save_dir)
    atomic_dir.clear_stale(save_dir)
    os.makedirs(os.path.dirname(save_dir), exist_ok=True)
    temp = atomic_dir.new_temp_dir(save_dir)
    os.mkdir(temp)
    try:
        with open(os.path.join(temp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf, f, indent=2)
        files = write_weights(tensors, temp, max_shard_size)
        write_tokenizer_files(source.args, temp, say)
        for name in os.listdir(temp):
            fsync_path(os.path.join(temp, name))
        atomic_dir.publish(temp, save_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    shards = f"{len(files) - 1} shards + index" if len(files) > 1 else files[0]
    say(f" wrote {save_dir} ({hf['architectures'][0]}, {len(tensors)} tensors, {shards})")
    return save_dir


def export_hf(
    load_dir: str,
    save_dir: str,
    say: Say = print,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Export the latest checkpoint of `load_dir` (megapipe's or Megatron-LM's) to transformers
    directory `save_dir` (weights sharded above `max_shard_size`: bytes, or "5GB", "500MB")."""
    directory, iteration = resolve(load_dir)
    say(f" reading {directory}")
    source = read_any(directory, iteration == RELEASE, say)  # megapipe's, or Megatron-LM's
    return export_source(source, save_dir, say, max_shard_size)
