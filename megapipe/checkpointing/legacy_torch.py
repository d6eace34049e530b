"""Megatron-LM's legacy per-rank `torch` checkpoint layout (`--ckpt-format torch`).

`SAVE/iter_0000100/mp_rank_{TP:02d}_{PP:03d}/model_optim_rng.pt` (`mp_rank_{TP:02d}` when PP=1),
written by data-parallel rank 0 of each model-parallel rank, holding

- `model` (`model0`, `model1`, ... with virtual pipeline stages): this rank's TP-local tensors
  under megapipe's (= Megatron-Core's) names and QKV layout, layers numbered from 0 within each
  chunk as Megatron's state dicts are;
- `optimizer`: this rank's optimizer state (torch's `state_dict()` of the inner optimizer and
  the fp32 masters when they are copies), layout-bound. With the distributed optimizer every
  data-parallel rank writes its own part beside it as `distrib_optim_{DP:03d}.pt` instead;
- `opt_param_scheduler` (`Progress.as_dict()`), `iteration`, `checkpoint_version` 3.0, `args`
  (megapipe's arguments as a dict of strings), `rng_state` (a list over data-parallel ranks,
  as Megatron's), and megapipe's `layout`, `layer_ranges`, `true_vocab_size`, `loss_scaler`.

Each mp_rank directory carries `checksums.json`; the iteration directory is written under a
temporary sibling and renamed into place, then the tracker is written. A checkpoint loads only
at the layout it was saved at; `tools/checkpoint/convert.py` rewrites it for another.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch

from megapipe.atomic_files import fsync_path
from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.agreement import agree, attempt, gather
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.run_state import (
    CHECKPOINT_VERSION,
    Progress,
    after_load,
    restore_rng,
    rng_shards,
)
from megapipe.checkpointing.safe_pickle import safe_torch_load
from megapipe.checkpointing.tracker import iteration_dir, write_tracker

if TYPE_CHECKING:
    from megapipe.checkpointing.checkpointer import Checkpointer

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


def wanted(checkpoint: Any) -> bool:
    """Whether the checkpoint --load names is in the legacy layout (loads go by what is on
    disk, whatever --ckpt-format says; that flag chooses what saves write)."""
    from megapipe.checkpointing.checkpointer import checkpoint_to_load

    iteration = checkpoint_to_load(checkpoint)
    return iteration is not None and is_legacy(iteration_dir(checkpoint.load, iteration))


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


def chunk_state(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A chunk's state dict as Megatron writes it: local layer numbers, own storage."""
    to_local = {g: i for i, g in enumerate(_layer_ids(chunk))}
    return {renumber(k, to_local): v.detach().clone() for k, v in chunk.state_dict().items()}


def load_chunk_state(chunk: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Fill a chunk in place from a Megatron-numbered state dict; every key must match."""
    to_global = dict(enumerate(_layer_ids(chunk)))
    try:
        renamed = {renumber(k, to_global): v for k, v in state.items()}
    except KeyError as e:
        raise CheckpointError(f"checkpoint file {where}: {e.args[0]}") from None
    own = chunk.state_dict()
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
    data = safe_torch_load(path, [argparse.Namespace])
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


def _optimizer_state(checkpointer: Checkpointer) -> dict[str, Any]:
    optimizer = checkpointer.optimizer
    masters = [m.detach().clone() for m in optimizer.masters]
    return {
        "inner": optimizer.inner.state_dict(),
        "fp32_masters": masters if optimizer.has_separate_masters else [],
        "sharded": optimizer.sharded,
    }


def save(checkpointer: Checkpointer, progress: Progress) -> tuple[str, float]:
    """Write SAVE/iter_N in the legacy layout and point the tracker at it (collective).
    Returns the path and the seconds it took (training waits for all of it)."""
    start = time.perf_counter()
    state, checkpoint = checkpointer.state, checkpointer.checkpoint
    assert checkpoint.save is not None
    directory = os.path.abspath(iteration_dir(checkpoint.save, progress.iteration))
    group = state.world.pg
    coordinator = state.rank == 0
    temp, error = (
        attempt(lambda: start_directory(directory), directory)
        if coordinator
        else (
            None,
            None,
        )
    )
    offers = gather((temp, error), group)
    agree(offers[0][1], group)
    temp = offers[0][0]
    assert temp is not None
    rng = {}
    if not checkpoint.no_save_rng:
        rng = {k: v[0].tensor for k, v in rng_shards(checkpointer.rng, state).items()}
    rng_list = gather(rng, state.dp.pg) if state.dp.size > 1 else [rng]
    with_optimizer = not checkpoint.no_save_optim
    sharded = checkpointer.optimizer.sharded
    sub = mp_rank_name(state.tp.rank, state.pp.rank, state.pp.size)

    def write() -> dict[str, dict]:
        path = os.path.join(temp, sub)
        os.makedirs(path, exist_ok=True)
        names = []
        if with_optimizer and sharded:
            name = distrib_optim_name(state.dp.rank)
            write_file(os.path.join(path, name), {"optimizer": _optimizer_state(checkpointer)})
            names.append(name)
        if state.dp.rank == 0:
            write_file(
                os.path.join(path, MODEL_FILE), _model_file(checkpointer, progress, rng_list)
            )
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
        write_tracker(checkpoint.save, progress.iteration)

    _, error = attempt(finish, directory) if coordinator else (None, None)
    if error and coordinator:
        shutil.rmtree(temp, ignore_errors=True)
    agree(error, group)
    return directory, time.perf_counter() - start


def _model_file(checkpointer: Checkpointer, progress: Progress, rng_list: list) -> dict:
    chunks, state = checkpointer.chunks, checkpointer.state
    optimizer = checkpointer.optimizer
    data: dict[str, Any] = {model_key(i, len(chunks)): chunk_state(c) for i, c in enumerate(chunks)}
    with_optimizer = not checkpointer.checkpoint.no_save_optim
    if with_optimizer and not optimizer.sharded:
        data["optimizer"] = _optimizer_state(checkpointer)
    scaler = optimizer.scaler
    data.update(
        common_entries(
            progress,
            dict(checkpointer.configs.arguments),
            checkpointer.layout,
            [[r.start, r.stop] for r in (_range_of(c) for c in chunks)],
            checkpointer.configs.model.vocab_size,
        )
    )
    data.update(
        {
            "has_optimizer": with_optimizer,
            "distributed_optimizer": optimizer.sharded,
            "has_rng": not checkpointer.checkpoint.no_save_rng,
            "rng_state": rng_list if not checkpointer.checkpoint.no_save_rng else [],
            "loss_scaler": scaler.state_dict() if scaler is not None else {},
        }
    )
    del state
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
) -> dict[str, Any]:
    """The non-tensor entries every model_optim_rng.pt carries (shared with the converter)."""
    return {
        "iteration": progress.iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "opt_param_scheduler": progress.as_dict(),
        "args": args,
        "layout": layout,
        "layer_ranges": layer_ranges,
        "true_vocab_size": true_vocab_size,
        "has_optimizer": False,
        "has_rng": False,
    }


# --- loading into a live run ----------------------------------------------------------------


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


def load(checkpointer: Checkpointer) -> tuple[Progress | None, list[str]]:
    """Load a legacy checkpoint saved at this run's layout (collective over the world)."""
    from megapipe.checkpointing.checkpointer import checkpoint_to_load

    checkpoint, state = checkpointer.checkpoint, checkpointer.state
    iteration = checkpoint_to_load(checkpoint)
    if iteration is None:
        return None, []
    directory = os.path.abspath(iteration_dir(checkpoint.load, iteration))
    notes = [f"loading checkpoint from {directory} at iteration {iteration}"]
    group = state.world.pg
    weights_only = checkpoint.finetune
    want_optimizer = not (weights_only or checkpoint.no_load_optim)
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
                _check_layout(directory, saved, checkpointer.layout, want_optimizer)
            raise CheckpointError(
                f"checkpoint {directory}: holds {sorted(present)}, this run at "
                f"{_describe(checkpointer.layout)} needs {sorted(expected)}; convert it with "
                "tools/checkpoint/convert.py"
            )
        _check_layout(
            directory,
            saved,
            checkpointer.layout,
            want_optimizer and data.get("has_optimizer", False),
        )
        for i, chunk in enumerate(checkpointer.chunks):
            key = model_key(i, len(checkpointer.chunks))
            if key not in data:
                raise CheckpointError(f"checkpoint file {sub}/{MODEL_FILE}: no {key!r} entry")
            load_chunk_state(chunk, data[key], f"{sub}/{MODEL_FILE} [{key}]")
        return data

    data, error = attempt(read, directory)
    agree(error, group)
    assert data is not None
    with_optimizer = want_optimizer and data.get("has_optimizer", False)
    if want_optimizer and not with_optimizer:
        notes.append(f"{directory} holds no optimizer state: the optimizer starts afresh")
    same_world = data["layout"].get("world_size") == checkpointer.layout["world_size"]
    with_rng = not (weights_only or checkpoint.no_load_rng) and data.get("has_rng", False)
    if with_rng and not same_world:
        notes.append("random states not restored: saved at another data-parallel size")
        with_rng = False

    def restore() -> None:
        optimizer = checkpointer.optimizer
        if with_optimizer:
            if data.get("distributed_optimizer"):
                saved = read_verified(sub, distrib_optim_name(state.dp.rank))["optimizer"]
            else:
                saved = data["optimizer"]
            _restore_optimizer(optimizer, saved, f"{sub}")
            scaler = optimizer.scaler
            if scaler is not None and data.get("loss_scaler"):
                scaler.load_state_dict(data["loss_scaler"])
        else:
            after_load(optimizer, None, masters_loaded=False)
        if with_rng:
            restore_rng(data["rng_state"][state.dp.rank], checkpointer.rng, state.rank)

    _, error = attempt(restore, directory)
    agree(error, group)
    if weights_only:
        return Progress(0, 0, 0, {}), notes
    return Progress.from_dict(data["opt_param_scheduler"]), notes


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
