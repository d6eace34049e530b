"""The weights of a Hugging Face directory, in transformers' layout: one `model.safetensors`, or,
above a size threshold, `model-00001-of-0000N.safetensors` shards with a
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}`).

Shards are cut as transformers' `save_pretrained(max_shard_size=...)` cuts them: tensors in
order, a new shard when the next one would pass the threshold, a tensor above it alone in its
own shard. Sizes are transformers' too: "5GB" is 5 * 10**9 bytes (its default), "500MB",
"2000000" (bytes); KiB/MiB/GiB/TiB are powers of 1024.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.errors import ConfigError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes of "5GB", "500MB", "1.5GiB" or "2000000"; ConfigError naming a bad one."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMGT]I?B|B)?", str(size).strip().upper())
    value = int(float(match[1]) * _UNITS[match[2] or "B"]) if match else 0
    if value <= 0:
        raise ConfigError(
            f"--max-shard-size {size!r}: not a positive size (e.g. 5GB, 500MB, 2000000)"
        )
    return value


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order: a new shard when the next tensor would pass
    `max_bytes`; a tensor bigger than that alone in its own shard."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        n = _nbytes(tensor)
        if n > max_bytes:
            shards.append([name])
            continue
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def write_weights(
    tensors: dict[str, torch.Tensor], directory: str, max_shard_size: str | int
) -> list[str]:
    """Write `tensors` into `directory` (a temporary one: the caller publishes it) as one file
    or as shards plus an index; returns the names of the files written."""
    from safetensors.torch import save_file

    shards = plan_shards(tensors, parse_size(max_shard_size))
    if len(shards) == 1:
        save_file(tensors, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
        _plain_file_mode(os.path.join(directory, WEIGHTS))
        return [WEIGHTS]
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(directory, file), {"format": "pt"})
        _plain_file_mode(os.path.join(directory, file))
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(_nbytes(t) for t in tensors.values())
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*files, INDEX]


def _plain_file_mode(path: str) -> None:
    """safetensors creates its files 0600; give them the mode open() gives the export's other
    files (0666 less the umask: 0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _load(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory: its index's shards, or `model.safetensors`."""
    index = os.path.join(directory, INDEX)
    if not os.path.exists(index):
        if not os.path.exists(os.path.join(directory, WEIGHTS)):
            raise CheckpointError(f"--load-dir {directory}: no {WEIGHTS} or {INDEX}")
        return _load(os.path.join(directory, WEIGHTS))
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index}: malformed ({error})") from None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        held = _load(os.path.join(directory, file))
        for name in (n for n, f in weight_map.items() if f == file):
            if name not in held:
                raise CheckpointError(f"{index}: tensor {name} is not in {file}, which it names")
            tensors[name] = held[name]
    return tensors
