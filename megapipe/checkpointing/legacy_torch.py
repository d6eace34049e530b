"""Megatron-LM's legacy per-rank `torch` checkpoint layout (`--ckpt-format torch`).

`SAVE/iter_0000100/mp_rank_{TP:02d}_{PP:03d}/model_optim_rng.pt` (`mp_rank_{TP:02d}` when PP=1),
written by data-parallel rank 0 of each model-parallel rank, holding

- `model` (`model0`, `model1`, ... with virtual pipeline stages): this rank's TP-local tensors
  under megapipe's (= Megatron-Core's) names and QKV layout, layers numbered from 0 within each
  chunk as Megatron's state dicts are;
- `optimizer`: this rank's optimizer state (torch's `state_dict()` of the inner optimizer and
  the fp32 masters when they are copies), layout-bound. With the distributed optimizer every
  data-parallel rank writes its own part beside it as `distrib_optim_{DP:03d}.pt` instead;
- `opt_param_scheduler` (`Progress.scheduler_entry`), `iteration`, `checkpoint_version` 3.0, `args`
  (Megatron-LM's `argparse.Namespace`, `megatron_args`), `rng_state` (a list over
  data-parallel ranks, as Megatron's), and megapipe's `megapipe_args` (its arguments as a dict
  of strings; older files have that dict under `args`), `layout`, `layer_ranges`,
  `true_vocab_size`, `loss_scaler`.

Each mp_rank directory carries `checksums.json`; the iteration directory is written under a
temporary sibling and renamed into place, then the tracker is written. A checkpoint loads only
at the layout it was saved at; `tools/checkpoint/convert.py` rewrites it for another.

This module reads and writes the files; what a load restores (`--finetune`, `--no-load-optim`,
`--no-load-rng`) is decided by `load_plan`, and the Checkpointer points the tracker.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megapipe.atomic_files import fsync_path
from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.agreement import agree, attempt, gather
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.layout_free import checkpointed_tensors
from megapipe.checkpointing.megatron_args import COMMON_PT_GLOBALS
from megapipe.checkpointing.run_state import (
    CHECKPOINT_VERSION,
    LiveRun,
    Progress,
    after_load,
    restore_rng,
    rng_shards,
)
from megapipe.checkpointing.safe_pickle import safe_torch_load

MODEL_FILE = "model_optim_rng.pt"
LAYER_PREFIX = "decoder.layers."


def mp_rank_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's per-model-parallel-rank directory name."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def distrib_optim_name(dp_rank: int) -> str:
    """The file a data-parallel rank's distributed-optimizer state goes to."""
    return f"distrib_optim_{dp_rank:03d}.pt"


def is_legacy(directory: str) -> bool:
    """Whether an iteration directory holds the legacy layout (mp_rank_* directories)."""
    return os.path.isdir(directory) and any(n.startswith("mp_rank_") for n in os.listdir(directory))


def model_key(chunk_index: int, num_chunks: int) -> str:
    """Megatron's entry name for a model chunk: `model`, or `model0`, `model1`, ..."""
    return "model" if num_chunks == 1 else f"model{chunk_index}"


# --- model state: megapipe's global layer numbers <-> Megatron's per-chunk numbers ---------


def _layer_ids(chunk: torch.nn.Module) -> list[int]:
    return [int(k) for k in chunk.decoder.layers]  # type: ignore[union-attr]


def renumber(name: str, mapping: dict[int, int]) -> str:
    """`decoder.layers.<i>.rest` with i replaced by mapping[i]; other names unchanged."""
    if not name.startswith(LAYER_PREFIX):
        return name
    index, rest = name[len(LAYER_PREFIX) :].split(".", 1)
    if not index.isdigit():
        return name
    if int(index) not in mapping:
        raise KeyError(f"layer {index} is not in this chunk (layers {sorted(mapping)})")
    return f"{LAYER_PREFIX}{mapping[int(index)]}.{rest}"


def _tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The chunk's state dict and the buffers checkpoints hold besides (routers' expert
    biases, which are not in the state dict)."""
    own = chunk.state_dict()
    for name, tensor in checkpointed_tensors(chunk):
        own.setdefault(name, tensor.detach())
    return own


def chunk_state(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A chunk's state dict as Megatron writes it: local layer numbers, own storage."""
    to_local = {g: i for i, g in enumerate(_layer_ids(chunk))}
    return {renumber(k, to_local): v.detach().clone() for k, v in _tensors(chunk).items()}


def load_chunk_state(chunk: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Fill a chunk in place from a Megatron-numbered state dict; every key must match."""
    to_global = dict(enumerate(_layer_ids(chunk)))
    try:
        renamed = {renumber(k, to_global): v for k, v in state.items()}
    except KeyError as e:
        raise CheckpointError(f"checkpoint file {where}: {e.args[0]}") from None
    own = _tensors(chunk)
    missing, extra = sorted(set(own) - set(renamed)), sorted(set(renamed) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint file {where}: model keys differ (missing {missing[:3]}, unexpected "
            f"{extra[:3]})"
        )
    for key, value in renamed.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise CheckpointError(
                f"checkpoint file {where}: tensor {key} has shape {tuple(value.shape)} in the "
                f"checkpoint, {tuple(own[key].shape)} in this model"
            )
    with torch.no_grad():
        for key, value in renamed.items():
            own[key].copy_(value)


# --- safe file i/o --------------------------------------------------------------------------


def read_file(path: str) -> dict:
    """A legacy checkpoint file, with weights_only=True (Megatron's `args` Namespace allowed)."""
    data = safe_torch_load(path, COMMON_PT_GLOBALS)
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint file {path}: holds a {type(data).__name__}, not a dict")
    return data


def read_verified(directory: str, name: str) -> dict:
    """`directory/name` checked against the directory's checksums.json, then read safely."""
    atomic_dir.verify_files(directory, [name])
    return read_file(os.path.join(directory, name))


def write_file(path: str, data: dict) -> None:
    """torch.save `data` to `path` (inside a temporary checkpoint directory) and fsync it."""
    with open(path, "wb") as f:
        torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())


def start_directory(directory: str) -> str:
    """The temporary sibling a save of `directory` writes into (created, stale ones cleared)."""
    os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
    atomic_dir.clear_stale(directory)
    temp = atomic_dir.new_temp_dir(directory)
    os.mkdir(temp)
    return temp


def finish_directory(temp: str, directory: str, digests: dict[str, dict[str, dict]]) -> None:
    """Write each mp_rank directory's checksums.json (`digests`: subdir -> file -> digest),
    then publish `temp` as `directory`."""
    present = sorted(n for n in os.listdir(temp))
    if present != sorted(digests):
        raise CheckpointError(
            f"checkpoint {directory}: mp_rank directories {present} were written, "
            f"{sorted(digests)} were expected"
        )
    for sub, table in digests.items():
        atomic_dir.write_checksums(os.path.join(temp, sub), table)
        fsync_path(os.path.join(temp, sub))
    atomic_dir.publish(temp, directory)


# --- saving from a live run -----------------------------------------------------------------


def _optimizer_state(run: LiveRun) -> dict[str, Any]:
    optimizer = run.optimizer
    masters = [m.detach().clone() for m in optimizer.masters]
    return {
        "inner": optimizer.inner.state_dict(),
        "fp32_masters": masters if optimizer.has_separate_masters else [],
        "sharded": optimizer.sharded,
    }


@dataclass(frozen=True)
class SaveContents:
    """What one legacy save writes besides the model: the choices and the run's records."""

    progress: Progress
    with_optimizer: bool  # not --no-save-optim
    with_rng: bool  # not --no-save-rng
    args: dict[str, str]  # the run's arguments, as strings
    true_vocab_size: int
    megatron_args: argparse.Namespace  # the same, as Megatron-LM's `args`


def save(
    run: LiveRun, directory: str, contents: SaveContents, then: Callable[[], None] | None = None
) -> None:
    """Write the iteration directory `directory` in the legacy layout (collective); `then`
    (rank 0's, e.g. pointing the tracker) runs once it is in place, its errors agreed too."""
    state = run.state
    directory = os.path.abspath(directory)
    group = state.world.pg
    coordinator = state.rank == 0
    temp, error = (
        attempt(lambda: start_directory(directory), directory) if coordinator else (None, None)
    )
    offers = gather((temp, error), group)
    agree(offers[0][1], group)
    temp = offers[0][0]
    assert temp is not None
    rng = {}
    if contents.with_rng:
        rng = {k: v[0].tensor for k, v in rng_shards(run.rng, state).items()}
    # one file per (TP, PP) rank, written by the first rank of DP x CP (whose ranks all hold
    # its parameters); the optimizer's shards and the random states are those of DP x CP
    replicas = state.dp_cp
    rng_list = gather(rng, replicas.pg) if replicas.size > 1 else [rng]
    sharded = run.optimizer.sharded
    sub = mp_rank_name(state.tp.rank, state.pp.rank, state.pp.size)

    def write() -> dict[str, dict]:
        path = os.path.join(temp, sub)
        os.makedirs(path, exist_ok=True)
        names = []
        if contents.with_optimizer and sharded:
            name = distrib_optim_name(replicas.rank)
            write_file(os.path.join(path, name), {"optimizer": _optimizer_state(run)})
            names.append(name)
        if replicas.rank == 0:
            write_file(os.path.join(path, MODEL_FILE), _model_file(run, contents, rng_list))
            names.append(MODEL_FILE)
        return atomic_dir.fsync_and_digest(path, names)

    mine, error = attempt(write, directory)
    digests = gather((sub, mine, error), group)
    agree(next((e for _, _, e in digests if e), None), group)

    def finish() -> None:
        tables: dict[str, dict[str, dict]] = {}
        for name, table, _ in digests:
            tables.setdefault(name, {}).update(table or {})
        finish_directory(temp, directory, tables)
        if then is not None:
            then()

    _, error = attempt(finish, directory) if coordinator else (None, None)
    if error and coordinator:
        shutil.rmtree(temp, ignore_errors=True)
    agree(error, group)


def _model_file(run: LiveRun, contents: SaveContents, rng_list: list) -> dict:
    chunks, optimizer = run.chunks, run.optimizer
    data: dict[str, Any] = {model_key(i, len(chunks)): chunk_state(c) for i, c in enumerate(chunks)}
    if contents.with_optimizer and not optimizer.sharded:
        data["optimizer"] = _optimizer_state(run)
    scaler = optimizer.scaler
    data.update(
        common_entries(
            contents.progress,
            contents.args,
            run.layout,
            [[r.start, r.stop] for r in (_range_of(c) for c in chunks)],
            contents.true_vocab_size,
            contents.megatron_args,
        )
    )
    data.update(
        {
            "has_optimizer": contents.with_optimizer,
            "distributed_optimizer": optimizer.sharded,
            "has_rng": contents.with_rng,
            "rng_state": rng_list if contents.with_rng else [],
            "loss_scaler": scaler.state_dict() if scaler is not None else {},
        }
    )
    return data


def _range_of(chunk: torch.nn.Module) -> range:
    ids = _layer_ids(chunk)
    return range(ids[0], ids[-1] + 1) if ids else range(0, 0)


def common_entries(
    progress: Progress,
    args: dict[str, str],
    layout: dict[str, int],
    layer_ranges: list[list[int]],
    true_vocab_size: int,
    megatron_args: argparse.Namespace,
) -> dict[str, Any]:
    """The non-tensor entries every model_optim_rng.pt carries (shared with the converter)."""
    return {
        "iteration": progress.iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "opt_param_scheduler": progress.scheduler_entry(),
        "args": megatron_args,
        "megapipe_args": args,
        "layout": layout,
        "layer_ranges": layer_ranges,
        "true_vocab_size": true_vocab_size,
        "has_optimizer": False,
        "has_rng": False,
    }


# --- loading into a live run (what is restored is the load plan's to decide) -----------------


def _describe(layout: dict) -> str:
    return (
        f"TP {layout.get('tensor_model_parallel_size')} x PP "
        f"{layout.get('pipeline_model_parallel_size')} (virtual "
        f"{layout.get('virtual_pipeline_model_parallel_size')}, world "
        f"{layout.get('world_size')})"
    )


def _check_layout(directory: str, saved: dict, here: dict, with_optimizer: bool) -> None:
    model_keys = (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
    )
    differs = any(saved.get(k) != here[k] for k in model_keys)
    if not differs and with_optimizer and saved.get("world_size") != here["world_size"]:
        differs = True
    if differs:
        raise CheckpointError(
            f"checkpoint {directory}: a legacy 'torch' checkpoint saved at {_describe(saved)} "
            f"cannot load at {_describe(here)}; convert it with tools/checkpoint/convert.py "
            "(or save with --ckpt-format torch_dist, which loads at any layout)"
        )


def read_model(run: LiveRun, directory: str, want_optimizer: bool) -> dict:
    """Read this rank's model file of the legacy checkpoint `directory`, check it was saved at
    this run's layout (the world size too when its optimizer state is wanted) and load the
    weights into the chunks (collective). Returns the file's entries."""
    state = run.state
    directory = os.path.abspath(directory)
    sub = os.path.join(directory, mp_rank_name(state.tp.rank, state.pp.rank, state.pp.size))

    def read() -> dict:
        expected = {
            mp_rank_name(t, p, state.pp.size)
            for t in range(state.tp.size)
            for p in range(state.pp.size)
        }
        present = {n for n in os.listdir(directory) if n.startswith("mp_rank_")}
        data = read_verified(sub, MODEL_FILE) if os.path.isdir(sub) else None
        saved = data.get("layout", {}) if data is not None else {}
        if data is None or present != expected:
            if data is not None and saved:
                _check_layout(directory, saved, run.layout, want_optimizer)
            raise CheckpointError(
                f"checkpoint {directory}: holds {sorted(present)}, this run at "
                f"{_describe(run.layout)} needs {sorted(expected)}; convert it with "
                "tools/checkpoint/convert.py"
            )
        _check_layout(
            directory, saved, run.layout, want_optimizer and data.get("has_optimizer", False)
        )
        for i, chunk in enumerate(run.chunks):
            key = model_key(i, len(run.chunks))
            if key not in data:
                raise CheckpointError(f"checkpoint file {sub}/{MODEL_FILE}: no {key!r} entry")
            load_chunk_state(chunk, data[key], f"{sub}/{MODEL_FILE} [{key}]")
        return data

    data, error = attempt(read, directory)
    agree(error, state.world.pg)
    assert data is not None
    return data


def restore(run: LiveRun, directory: str, data: dict, *, optimizer: bool, rng: bool) -> None:
    """Restore the optimizer (and loss scaler) and the random states `read_model` found, as far
    as the load plan says (collective)."""
    state = run.state
    directory = os.path.abspath(directory)
    sub = os.path.join(directory, mp_rank_name(state.tp.rank, state.pp.rank, state.pp.size))

    def restore() -> None:
        if optimizer:
            if data.get("distributed_optimizer"):
                saved = read_verified(sub, distrib_optim_name(state.dp_cp.rank))["optimizer"]
            else:
                saved = data["optimizer"]
            _restore_optimizer(run.optimizer, saved, f"{sub}")
            scaler = run.optimizer.scaler
            if scaler is not None and data.get("loss_scaler"):
                scaler.load_state_dict(data["loss_scaler"])
        else:
            after_load(run.optimizer, None, masters_loaded=False)
        if rng:
            restore_rng(data["rng_state"][state.dp_cp.rank], run.rng, state.rank)

    _, error = attempt(restore, directory)
    agree(error, state.world.pg)


def _restore_optimizer(optimizer: Any, saved: dict, where: str) -> None:
    masters = saved.get("fp32_masters", [])
    if masters and len(masters) != len(optimizer.masters):
        raise CheckpointError(
            f"checkpoint {where}: {len(masters)} fp32 masters saved, the optimizer has "
            f"{len(optimizer.masters)}"
        )
    try:
        optimizer.inner.load_state_dict(saved["inner"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {where}: optimizer state does not fit ({e})") from None
    with torch.no_grad():
        for master, value in zip(optimizer.masters, masters):
            if master.shape != value.shape:
                raise CheckpointError(
                    f"checkpoint {where}: fp32 master of shape {tuple(value.shape)}, the "
                    f"optimizer's is {tuple(master.shape)}"
                )
            master.copy_(value)
    after_load(optimizer, None, masters_loaded=bool(masters))
