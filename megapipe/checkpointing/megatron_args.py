"""A checkpoint's `args` as Megatron-LM writes and reads them: an `argparse.Namespace`.

Megatron-LM's `save_checkpoint` stores its parsed arguments (Megatron's names, typed values:
ints, floats, bools, None, lists, torch dtypes such as `params_dtype`) under `args`, and its
loader reads them back from there (`--use-checkpoint-args`, the converters, consumed samples).
megapipe's flags have Megatron's names, so the Namespace is the run's flags with their typed
values, overridden by what megapipe's configs resolved (the tokenizer's vocabulary, the padded
vocabulary, --ffn-hidden-size and --kv-channels defaults, train iterations from samples, the
layout) and the few names Megatron spells differently (`norm_epsilon`).

megapipe's own readers keep reading its dict of strings, stored beside it as `megapipe_args`
(`saved_arguments` finds it, or the `args` dict of checkpoints written before the Namespace).
Loading a common.pt with weights_only=True needs the Namespace class allowed:
`COMMON_PT_GLOBALS` is that allow-list, one place for every reader.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Mapping
from typing import Any

import torch

from megapipe.config import Configs, ModelConfig

# Classes a common.pt (or a legacy model_optim_rng.pt) may hold besides tensors and plain
# python types: what Megatron-LM's save_checkpoint pickles there.
COMMON_PT_GLOBALS: tuple[type, ...] = (argparse.Namespace,)


def _typed(text: str) -> Any:
    """A recorded flag value (its repr) back as a plain python value; lists for tuples."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(value, tuple):
        value = list(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return value
    return text  # e.g. a dict or a set: kept as the text it was recorded as


def _model_values(model: ModelConfig, tp: int) -> dict[str, Any]:
    groups = model.num_query_groups
    return {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "group_query_attention": groups != model.num_attention_heads,
        "num_query_groups": groups,
        "kv_channels": model.head_dim,
        "seq_length": model.seq_length,
        "max_position_embeddings": model.max_position_embeddings,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.padded_vocab_size(tp),
        "make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
        "normalization": model.normalization,
        "norm_epsilon": model.layernorm_epsilon,
        "layernorm_epsilon": model.layernorm_epsilon,
        "qk_layernorm": model.qk_layernorm,
        "swiglu": model.swiglu,
        "openai_gelu": model.openai_gelu,
        "squared_relu": model.squared_relu,
        "position_embedding_type": model.position_embedding_type,
        "rotary_base": model.rotary_base,
        "rotary_percent": model.rotary_percent,
        "apply_residual_connection_post_layernorm": model.apply_residual_connection_post_layernorm,
        "untie_embeddings_and_output_weights": model.untie_embeddings_and_output_weights,
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.add_bias_linear,
        "init_method_std": model.init_method_std,
        "attention_dropout": model.attention_dropout,
        "hidden_dropout": model.hidden_dropout,
    }


def _namespace(
    arguments: Mapping[str, str],
    model: ModelConfig,
    layout: Mapping[str, int | None],
    resolved: Mapping[str, Any],
) -> argparse.Namespace:
    values: dict[str, Any] = {k: _typed(v) for k, v in arguments.items()}
    tp = int(layout["tensor_model_parallel_size"] or 1)
    pp = int(layout["pipeline_model_parallel_size"] or 1)
    cp = int(layout.get("context_parallel_size") or 1)
    vp = layout.get("virtual_pipeline_model_parallel_size")
    world = int(layout.get("world_size") or tp * cp * pp)
    values.update(_model_values(model, tp))
    values.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        world_size=world,
        data_parallel_size=max(1, world // (tp * cp * pp)),
    )
    values.update(resolved)
    if values.get("tokenizer_type") == "NullTokenizer":  # Megatron's flag: the ids before eod
        values["vocab_size"] = model.vocab_size - 1
    fp16, bf16 = bool(values.get("fp16")), bool(values.get("bf16"))
    values["params_dtype"] = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return argparse.Namespace(**dict(sorted(values.items())))


def megatron_namespace(
    configs: Configs,
    *,
    iteration: int = 0,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
) -> argparse.Namespace:
    """The run's arguments as Megatron-LM's `save_checkpoint` stores them in `args`."""
    training, optimizer, data = configs.training, configs.optimizer, configs.data
    parallel = configs.parallel
    resolved = {
        "micro_batch_size": training.micro_batch_size,
        "global_batch_size": training.global_batch_size,
        "train_iters": training.train_iters,
        "lr": training.lr,
        "min_lr": training.min_lr,
        "lr_decay_style": training.lr_decay_style,
        "lr_warmup_iters": training.lr_warmup_iters,
        "lr_decay_iters": training.lr_decay_iters,
        "seed": training.seed,
        "optimizer": optimizer.optimizer,
        "weight_decay": optimizer.weight_decay,
        "clip_grad": optimizer.clip_grad,
        "adam_beta1": optimizer.adam_beta1,
        "adam_beta2": optimizer.adam_beta2,
        "adam_eps": optimizer.adam_eps,
        "fp16": optimizer.fp16,
        "bf16": optimizer.bf16,
        "use_distributed_optimizer": optimizer.use_distributed_optimizer,
        "tokenizer_type": data.tokenizer_type,
        "tokenizer_model": data.tokenizer_model,
        "vocab_file": data.vocab_file,
        "merge_file": data.merge_file,
        "sequence_parallel": parallel.sequence_parallel,
        "ckpt_format": configs.checkpoint.ckpt_format,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
    }
    layout = {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
        "world_size": configs.world_size,
    }
    return _namespace(dict(configs.arguments), configs.model, layout, resolved)


def converted_namespace(
    arguments: Mapping[str, str],
    model: ModelConfig,
    layout: Mapping[str, int | None],
    *,
    iteration: int = 0,
    consumed_train_samples: int = 0,
) -> argparse.Namespace:
    """`megatron_namespace` for a checkpoint rewritten by the converter: from the saved
    arguments (strings) and the model they describe, at the converted `layout`."""
    resolved = {
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": 0,
    }
    return _namespace(arguments, model, layout, resolved)


def saved_arguments(entries: Mapping[str, Any]) -> dict[str, str]:
    """megapipe's arguments (a dict of strings) from a common.pt or legacy checkpoint file's
    entries: `megapipe_args`, or `args` when that is a dict (checkpoints written before
    `args` became Megatron-LM's Namespace); {} when there are neither."""
    found = entries.get("megapipe_args")
    if isinstance(found, dict):
        return dict(found)
    found = entries.get("args")
    return dict(found) if isinstance(found, dict) else {}
