"""`--use-checkpoint-args`: the model's shape and tokenizer taken from the checkpoint `--load`
names (megapipe's or Megatron-LM's, either format), as Megatron-LM's
`load_args_from_checkpoint` does: the checkpoint's values win over the command line's.

They are turned back into flags and appended to argv, so they go through the same parsing and
validation as typed ones.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence

from megapipe.checkpointing import legacy_torch, megatron_lm
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.megatron_args import saved_arguments
from megapipe.checkpointing.torch_dist import load_common
from megapipe.checkpointing.tracker import checkpoint_path, read_tracker
from megapipe.errors import ConfigError

FLAG = "--use-checkpoint-args"
# saved argument name -> flag; valued flags take the value, switches are given when true
VALUED = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
    "seq_length": "--seq-length", "max_position_embeddings": "--max-position-embeddings",
    "position_embedding_type": "--position-embedding-type", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent", "normalization": "--normalization",
    "layernorm_epsilon": "--layernorm-epsilon",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
    "tokenizer_type": "--tokenizer-type", "tokenizer_model": "--tokenizer-model",
    "vocab_file": "--vocab-file", "merge_file": "--merge-file", "vocab_size": "--vocab-size",
}  # fmt: skip
SWITCHES = {
    "group_query_attention": "--group-query-attention", "swiglu": "--swiglu",
    "squared_relu": "--squared-relu", "openai_gelu": "--openai-gelu",
    "qk_layernorm": "--qk-layernorm",
    "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
}  # fmt: skip


def _value_after(argv: Sequence[str], flag: str) -> str | None:
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def _saved_args(directory: str) -> dict[str, str]:
    """The arguments a checkpoint directory records, as megapipe saves them."""
    if megatron_lm.is_megatron_lm(directory):
        return megatron_lm.read_run(directory).args
    if legacy_torch.is_legacy(directory):
        first = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))[0]
        return saved_arguments(legacy_torch.read_verified(os.path.join(directory, first)))
    return saved_arguments(load_common(directory))


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


REQUIRED_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(token == flag or token.startswith(flag + "=") for token in argv)


def checkpoint_flags(argv: Sequence[str], known: set[str]) -> list[str]:
    """The flags to append to `argv` (those among `known`, the parser's): with
    --use-checkpoint-args every model flag the checkpoint records (the checkpoint wins); without
    it, when --load names a checkpoint and the command line lacks the model's required flags,
    the ones it does not give (the command line wins); else none."""
    if FLAG in argv:
        return _flags_of_checkpoint(argv, known)
    missing = [flag for flag in REQUIRED_MODEL_FLAGS if not _given(argv, flag)]
    load = _value_after(argv, "--load")
    if not missing or load is None or read_tracker_quietly(load) is None:
        return []  # argparse names the missing flags, as before
    flags = _flags_of_checkpoint(argv, known)
    return _not_given(flags, argv)


def read_tracker_quietly(load: str) -> int | None:
    """The tracker's iteration, or None when there is none or it cannot be read (the load
    itself reports that later)."""
    try:
        return read_tracker(load)
    except CheckpointError:
        return None


def _not_given(flags: list[str], argv: Sequence[str]) -> list[str]:
    """`flags` without those `argv` gives (a switch, or a flag with its value)."""
    out, i = [], 0
    while i < len(flags):
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        item = flags[i : i + 2] if takes_value else flags[i : i + 1]
        if not _given(argv, flags[i]):
            out += item
        i += len(item)
    return out


def _flags_of_checkpoint(argv: Sequence[str], known: set[str]) -> list[str]:
    load = _value_after(argv, "--load")
    if load is None:
        raise ConfigError(f"{FLAG} needs --load (the checkpoint whose arguments to use)")
    try:
        iteration = read_tracker(load)
        if iteration is None:
            raise CheckpointError(f"{load}: no latest_checkpointed_iteration.txt")
        args = _saved_args(checkpoint_path(load, iteration))
    except CheckpointError as error:
        raise ConfigError(f"{FLAG}: --load {error}") from None
    if not args:
        raise ConfigError(f"{FLAG}: --load {load}: the checkpoint records no arguments")
    flags: list[str] = []
    for name, flag in VALUED.items():
        value = _literal(args[name]) if name in args else None
        if value is not None and flag in known:
            flags += [flag, str(value)]
    for name, flag in SWITCHES.items():
        if name in args and _literal(args[name]) is True and flag in known:
            flags.append(flag)
    if _literal(args.get("add_bias_linear", "True")) is False and "--disable-bias-linear" in known:
        flags.append("--disable-bias-linear")
    return flags
