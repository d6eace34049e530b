"""Checkpoints that Megatron-LM wrote: recognised, read without running their pickles' code,
and put in megapipe's terms.

Megatron-LM's `save_checkpoint` writes, in torch_dist, DCP shards whose keys megapipe's
layout-free names already follow (stacked layers, TransformerEngine's fused norm names, the
padded vocabulary rows, `_extra_state` byte entries), plus `common.pt`; in the legacy `torch`
format one `mp_rank_TT[_PPP]/model_optim_rng.pt` per model-parallel rank with that rank's
TP-local tensors under per-stage layer numbers. Both carry `args` (an `argparse.Namespace` of
Megatron-LM's argument names: ints, floats, strings, lists, torch dtypes and a few Megatron-Core
enums), `checkpoint_version`, `iteration` and `opt_param_scheduler`. What differs from
megapipe's own checkpoints is what says how to read them: no `layout` entry, arguments in a
Namespace, no checksums. This module turns `args` into the string dict megapipe saves (its
argument names are Megatron-LM's), finds the real vocabulary (the padding rows are cut off by
the readers), and the run's progress.

Safety: the pickles load with `weights_only=True`; `argparse.Namespace` and stand-ins for the
Megatron-Core enums listed below are the only classes allowed (a stand-in records the enum's
name and value; it runs nothing). Anything else a pickle names is refused in one line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from megapipe.checkpointing.atomic_dir import CHECKSUMS_NAME
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.run_state import Progress
from megapipe.checkpointing.safe_pickle import safe_torch_load
from megapipe.data.tokenizers.base import TokenizerSpec
from megapipe.data.tokenizers.factory import build_tokenizer

# Megatron-Core enums that Megatron-LM's args may hold (`--attention-backend`, the model type,
# fp8/fp4 recipes, CUDA-graph scopes), as the module paths their pickles name.
FOREIGN_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
)


class ForeignEnum:
    """A Megatron-Core enum member as a pickle names it: the enum's path and the value. Holds
    data only; `qualname` is set per enum by `_stand_in`."""

    qualname = "enum"

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{self.qualname.rsplit('.', 1)[-1]}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.qualname, self.value))


def _stand_in(qualname: str) -> type[ForeignEnum]:
    return type(qualname.rsplit(".", 1)[-1], (ForeignEnum,), {"qualname": qualname})


# What `weights_only` loading may build from a Megatron-LM pickle besides tensors and plain
# values: for torch.serialization.safe_globals (a class, or (stand-in, the name it replaces)).
MEGATRON_GLOBALS: list[Any] = [argparse.Namespace, *((_stand_in(q), q) for q in FOREIGN_ENUMS)]

MODEL_FILE = "model_optim_rng.pt"
COMMON = "common.pt"
# megapipe's ModelConfig field -> the Megatron-LM argument that holds it, where they differ
_RENAMED = {"layernorm_epsilon": "norm_epsilon"}
# Megatron-LM arguments (value that megapipe supports) whose other values megapipe cannot build
_SUPPORTED_ONLY = {
    "multi_latent_attention": False,
    "apply_layernorm_1p": False,
    "mtp_num_layers": None,
    "heterogeneous_layers_config_path": None,
    "use_rope_scaling": False,
}


def load_pickle(path: str) -> dict:
    """A Megatron-LM `common.pt` or `model_optim_rng.pt`, loaded through the allow-list, its
    tensors memory-mapped: recognising a checkpoint and reading its `args` (which loads the
    first rank file, then again to assemble the weights) reads the tensor data once at most."""
    data = safe_torch_load(path, MEGATRON_GLOBALS, mmap=True)
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint file {path}: holds a {type(data).__name__}, not a dict")
    return data


def _legacy_files(directory: str) -> list[str]:
    return sorted(
        n
        for n in os.listdir(directory)
        if n.startswith("mp_rank_") and os.path.isdir(os.path.join(directory, n))
    )


def first_file(directory: str) -> str | None:
    """The pickle that holds a checkpoint's `args`: common.pt (torch_dist) or the first
    mp_rank file (legacy torch); None when neither is there."""
    common = os.path.join(directory, COMMON)
    if os.path.isfile(common):
        return common
    names = _legacy_files(directory) if os.path.isdir(directory) else []
    return os.path.join(directory, names[0], MODEL_FILE) if names else None


def is_megatron_lm(directory: str) -> bool:
    """Whether an iteration directory was written by Megatron-LM rather than megapipe:
    no checksums.json beside its first file, its `args` is a Namespace and it has no megapipe
    `layout` entry. (Reads one pickle, through the allow-list; a damaged file is reported by
    whoever reads it next.)"""
    path = first_file(directory)
    if path is None:
        return False
    if os.path.exists(os.path.join(os.path.dirname(path), CHECKSUMS_NAME)):
        return False  # megapipe writes checksums beside every file it saves; Megatron-LM none
    try:
        data = load_pickle(path)
    except CheckpointError:
        return False
    return isinstance(data.get("args"), argparse.Namespace) and "layout" not in data


@dataclass
class MegatronRun:
    """What a Megatron-LM checkpoint says about its run, in megapipe's terms."""

    directory: str
    format: str  # "torch_dist" or "torch"
    namespace: argparse.Namespace  # Megatron-LM's args as saved
    args: dict[str, str]  # the same, as megapipe saves its arguments (repr of each value)
    vocab_size: int  # the real vocabulary (the rows past it are padding)
    padded_vocab_size: int
    progress: Progress
    scheduler: dict | None  # Megatron's opt_param_scheduler state, as saved
    release: bool  # a `release` checkpoint: weights only, training starts at iteration 0
    notes: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return int(getattr(self.namespace, "tensor_model_parallel_size", 1) or 1)

    @property
    def pp(self) -> int:
        return int(getattr(self.namespace, "pipeline_model_parallel_size", 1) or 1)

    @property
    def virtual_stages(self) -> int:
        ns = self.namespace
        vp = getattr(ns, "virtual_pipeline_model_parallel_size", None)
        per_stage = getattr(ns, "num_layers_per_virtual_pipeline_stage", None)
        if not vp and per_stage:
            vp = int(ns.num_layers) // (per_stage * self.pp)
        return int(vp or 1)


def _unsupported(ns: argparse.Namespace, where: str) -> None:
    for name, supported in _SUPPORTED_ONLY.items():
        value = getattr(ns, name, supported)
        if value not in (supported, None, False, 0):
            raise CheckpointError(
                f"checkpoint {where}: Megatron-LM's {name} = {value!r} is a model megapipe "
                "cannot build yet"
            )
    if getattr(ns, "add_qkv_bias", False) and not getattr(ns, "add_bias_linear", True):
        raise CheckpointError(
            f"checkpoint {where}: Megatron-LM's add_qkv_bias without add_bias_linear (a bias on "
            "QKV only) is a model megapipe cannot build yet"
        )
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(ns, name, None) and getattr(ns, "ckpt_format", "") == "torch":
            raise CheckpointError(
                f"checkpoint {where}: a legacy torch checkpoint with Megatron-LM's {name} = "
                f"{getattr(ns, name)} (uneven stages) is not read yet; convert it to torch_dist "
                "with Megatron-LM first"
            )


# Megatron-LM MoE arguments (value megapipe supports) whose other values it cannot build
_MOE_SUPPORTED_ONLY = {"moe_shared_expert_gate": False, "moe_router_num_groups": None}


def _unsupported_moe(ns: argparse.Namespace, where: str, fmt: str) -> None:
    """An MoE model megapipe reads: torch_dist (Megatron-Core's SequentialMLP keys, which
    megapipe's own checkpoints use), without Megatron-Core's router bias."""
    experts = getattr(ns, "num_experts", None)
    if not experts:
        return
    if getattr(ns, "add_bias_linear", True):
        raise CheckpointError(
            f"checkpoint {where}: Megatron-LM's num_experts = {experts} with add_bias_linear (a "
            "bias on the MoE router, which megapipe's router lacks) is a model megapipe cannot "
            "build yet"
        )
    if fmt == "torch":
        raise CheckpointError(
            f"checkpoint {where}: a legacy torch checkpoint of an MoE model (Megatron-LM's "
            f"num_experts = {experts}) is not read yet; convert it to torch_dist with "
            "Megatron-LM first"
        )
    for name, supported in _MOE_SUPPORTED_ONLY.items():
        value = getattr(ns, name, supported)
        if value not in (supported, None, False, 0):
            raise CheckpointError(
                f"checkpoint {where}: Megatron-LM's {name} = {value!r} is a model megapipe "
                "cannot build yet"
            )


def real_vocab_size(ns: argparse.Namespace) -> tuple[int, str | None]:
    """The tokenizer's vocabulary (the rows before the padding), and a note when it could only
    be taken as the padded size. NullTokenizer has --vocab-size ids plus its eod, as in
    Megatron-LM; other tokenizers are built from the files the args name, where they exist."""
    padded = int(ns.padded_vocab_size)
    kind = getattr(ns, "tokenizer_type", None)
    if kind == "NullTokenizer" and getattr(ns, "vocab_size", None):
        return int(ns.vocab_size) + 1, None
    spec = TokenizerSpec(
        str(kind),
        getattr(ns, "tokenizer_model", None),
        getattr(ns, "vocab_file", None),
        getattr(ns, "merge_file", None),
        None,
        int(getattr(ns, "vocab_extra_ids", 0) or 0),
    )
    try:
        return int(build_tokenizer(spec).vocab_size), None
    except Exception as error:  # files not here, or a type megapipe lacks
        return padded, (
            f"the real vocabulary of tokenizer {kind!r} could not be read ({error}); all "
            f"{padded} rows are treated as real, so padding ids are not masked in generation"
        )


def megapipe_args(ns: argparse.Namespace, vocab_size: int) -> dict[str, str]:
    """Megatron-LM's args as megapipe records its own (name -> repr of the value), with the
    few names that differ added under megapipe's."""
    args = {k: repr(v) for k, v in vars(ns).items()}
    for ours, theirs in _RENAMED.items():
        if theirs in args and ours not in args:
            args[ours] = args[theirs]
    if getattr(ns, "use_rotary_position_embeddings", False):
        args["position_embedding_type"] = repr("rope")
    if not getattr(ns, "group_query_attention", False):
        args["num_query_groups"] = repr(None)
    args["true_vocab_size"] = repr(vocab_size)
    return args


def progress_of(data: dict, ns: argparse.Namespace, release: bool) -> Progress:
    """Iteration, consumed samples and the LR schedule's clock (Megatron's num_steps, which
    counts samples for iteration-based training) of the saved run."""
    if release:
        return Progress()
    iteration = int(data.get("iteration", getattr(ns, "iteration", 0)) or 0)
    consumed = int(getattr(ns, "consumed_train_samples", 0) or 0)
    scheduler = data.get("opt_param_scheduler") or {}
    scheduled = int(scheduler.get("num_steps", consumed))
    return Progress(iteration, consumed, scheduled, None)


def read_run(directory: str, release: bool = False) -> MegatronRun:
    """The run a Megatron-LM checkpoint directory (an iteration's, or `release/`) comes from."""
    directory = os.path.abspath(directory)
    path = first_file(directory)
    if path is None:
        raise CheckpointError(
            f"checkpoint {directory}: neither common.pt nor an mp_rank_* folder is there"
        )
    data = load_pickle(path)
    ns = data.get("args")
    if not isinstance(ns, argparse.Namespace):
        raise CheckpointError(f"checkpoint file {path}: no Megatron-LM args (a Namespace)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if getattr(ns, name, None) is None:
            raise CheckpointError(f"checkpoint file {path}: args lack {name}")
    _unsupported(ns, directory)
    fmt = "torch_dist" if path.endswith(COMMON) else "torch"
    _unsupported_moe(ns, directory, fmt)
    vocab, note = real_vocab_size(ns)
    return MegatronRun(
        directory=directory,
        format=fmt,
        namespace=ns,
        args=megapipe_args(ns, vocab),
        vocab_size=vocab,
        padded_vocab_size=int(ns.padded_vocab_size),
        progress=progress_of(data, ns, release),
        scheduler=None if release else data.get("opt_param_scheduler"),
        release=release,
        notes=(note,) if note else (),
    )


def legacy_model_states(data: dict, path: str) -> list[dict]:
    """One rank's model chunks (`model`, or `model0`, `model1`, ...) without `_extra_state`
    entries (TransformerEngine's FP8 metadata; None for Megatron-Core's local layers)."""
    keys = (
        ["model"]
        if "model" in data
        else sorted(k for k in data if k[5:].isdigit() and k.startswith("model"))
    )
    if not keys:
        raise CheckpointError(f"checkpoint file {path}: no model entry")
    states = []
    for key in sorted(keys, key=lambda k: int(k[5:] or 0)):
        state = data[key]
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint file {path}: {key} is not a state dict")
        states.append({k: v for k, v in state.items() if not k.endswith("._extra_state")})
    return states


def legacy_file(directory: str, tp_rank: int, pp_rank: int, pp: int) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    path = os.path.join(directory, name, MODEL_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {directory}: {name}/{MODEL_FILE} is missing (its args say TP x PP "
            f"layout needs every mp_rank folder)"
        )
    return path
