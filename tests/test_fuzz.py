"""Fuzz the readers of untrusted input (hypothesis): the preprocessor's JSONL reader, the GPT
dataset built on mutated .bin/.idx pairs, the checkpoint loaders (DCP metadata with the
allow-list unpickler, the torch_dist load planner, weights_only torch files) and the argument
parser (random argv drawn from the real flag set). Each finds no exception but the intended
one-line errors: DataError, CheckpointError, ConfigError.

Bounded for CI; `MEGAPIPE_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py
tests/test_indexed_fuzz.py` runs every fuzzer that many examples. (The .idx reader itself is
fuzzed in tests/test_indexed_fuzz.py.)
"""

from __future__ import annotations

import functools
import io
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from megapipe.arguments import build_parser, parse_args
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.safe_pickle import load_dcp_metadata, safe_torch_load
from megapipe.checkpointing.shards import TensorShard
from megapipe.checkpointing.torch_dist import DCP_METADATA, load_sharded, save_sharded
from megapipe.data.document_encoder import EncodeSettings, encode_chunk
from megapipe.data.errors import DataError
from megapipe.data.gpt_builder import build_split_dataset, train_source
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.input_issues import InputIssue
from megapipe.data.jsonl import parse_json_line, read_chunks
from megapipe.data.tokenizers import TokenizerSpec
from megapipe.errors import ConfigError
from tests.helpers import argv as tiny_argv
from tests.helpers import fuzz_settings


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    """`data` with bytes overwritten at (position mod size, value), then cut or padded."""
    out = bytearray(data)
    for position, value in edits:
        if out:
            out[position % len(out)] = value
    return bytes(out[: max(len(out) + cut, 0)]) if cut < 0 else bytes(out) + bytes(cut)


EDITS = st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 255)), max_size=6)

# --- the preprocessor's JSONL reader --------------------------------------------------------

JSON_TEXT = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),  # fmt: skip
    max_leaves=6,
).map(json.dumps)
LINE = st.one_of(
    st.binary(max_size=40),
    JSON_TEXT.map(str.encode),
    st.builds(lambda t: json.dumps({"text": t}).encode(), st.text(max_size=20)),
    st.builds(lambda t: b'{"text": "' + t + b'"}', st.binary(max_size=20)),  # raw bytes inside
    st.just(b"[" * 5000),  # nested deeper than the recursion limit
)


@fuzz_settings(100)
@given(
    lines=st.lists(LINE, max_size=8),
    ending=st.sampled_from([b"\n", b"\r\n"]),
    last_newline=st.booleans(),
    max_line=st.integers(1, 64),
)
def test_jsonl_reader(lines: list[bytes], ending: bytes, last_newline: bool, max_line: int) -> None:
    data = ending.join(lines) + (ending if last_newline and lines else b"")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "in.jsonl")
        Path(path).write_bytes(data)
        chunks = list(read_chunks(path, max_lines=3, max_bytes=50, max_line_bytes=max_line))
    raw = [line for chunk in chunks for line in chunk.lines]
    assert len(raw) == data.count(b"\n") + (not data.endswith(b"\n") and len(data) > 0)
    assert sum(chunk.num_bytes for chunk in chunks) == len(data)
    assert [chunk.first_line for chunk in chunks] == [
        1 + sum(len(c.lines) for c in chunks[:i]) for i in range(len(chunks))
    ]
    settings_ = EncodeSettings(TokenizerSpec("NullTokenizer", vocab_size=50), ("text",),
                               "uint16", append_eod=True)  # fmt: skip
    for chunk in chunks:
        for offset, line in enumerate(chunk.lines):
            parsed = parse_json_line(line, chunk.first_line + offset, ("text",))
            assert isinstance(parsed, (dict, InputIssue))
            if isinstance(line, InputIssue):
                assert line.kind == "line too long"
        encoded = encode_chunk(settings_, chunk)  # bad input is an issue, never an exception
        assert encoded.num_documents + len(encoded.issues) == len(chunk.lines)
        tokens = encoded.arrays["text"]
        assert tokens.sequence_lengths.sum() == tokens.tokens.size
        assert tokens.tokens.size == 0 or tokens.tokens.max() <= 50


# --- the GPT dataset on mutated .bin/.idx pairs ---------------------------------------------


def _write_pair(prefix: str, lengths: list[int]) -> None:
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for n in lengths:
            builder.add_item(np.arange(n) % 50)
            builder.end_document()


@fuzz_settings(40)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    edits=EDITS,
    cut=st.integers(-6, 6),
    bin_cut=st.integers(-4, 4),
    split=st.sampled_from(["1", "969,30,1", "1,1", "0,1", "2,0,1"]),
    seq_length=st.integers(1, 12),
    samples=st.integers(1, 20),
)
def test_gpt_dataset_on_mutated_files(lengths, edits, cut, bin_cut, split, seq_length, samples):
    with tempfile.TemporaryDirectory() as directory:
        prefix = os.path.join(directory, "d")
        _write_pair(prefix, lengths)
        idx, binary = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        idx.write_bytes(mutate(idx.read_bytes(), edits, cut))
        binary.write_bytes(mutate(binary.read_bytes(), [], bin_cut))
        try:
            source = train_source([prefix], split, [])
            ds = build_split_dataset(source, num_samples=samples, seq_length=seq_length, seed=1,
                                     cache_dir=os.path.join(directory, "cache"))  # fmt: skip
        except DataError as error:
            assert "\n" not in str(error)
            return
        assert len(ds) >= samples
        for i in range(len(ds)):
            sample = ds[i]
            assert sample.shape == (seq_length + 1,) and sample.dtype == np.int64


# --- checkpoint loaders ---------------------------------------------------------------------

SHAPE = (4, 6)


@functools.cache
def checkpoint() -> dict[str, bytes]:
    """The bytes of a tiny torch_dist checkpoint's files (one process), and of a torch file."""
    with tempfile.TemporaryDirectory() as root:
        directory = Path(root) / "iter_0000001"
        weight = torch.arange(24.0).reshape(SHAPE)
        state = {"w": [TensorShard(weight[:2], (0, 0), SHAPE),
                       TensorShard(weight[2:], (2, 0), SHAPE)],
                 "step": [TensorShard(torch.tensor(3), (), ())]}  # fmt: skip
        save_sharded(str(directory), state, {"iteration": 1}, group=None, coordinator=True)
        files = {name: (directory / name).read_bytes() for name in os.listdir(directory)}
    buffer = io.BytesIO()
    torch.save({"iteration": 1, "model": {"w": weight}, "args": {"lr": 0.1}}, buffer)
    files["legacy.pt"] = buffer.getvalue()
    return files


def _materialise(directory: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        if name not in ("checksums.json", "legacy.pt"):  # foreign: only the safe readers guard
            Path(directory, name).write_bytes(data)


@fuzz_settings(100)
@given(edits=EDITS, cut=st.integers(-40, 8))
@example(edits=[(256, 10)], cut=0)  # a newline in a refused global's name (CI, 2026-11-30)
def test_dcp_metadata_reader(edits, cut) -> None:
    data = mutate(checkpoint()[DCP_METADATA], edits, cut)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, DCP_METADATA)
        Path(path).write_bytes(data)
        try:
            load_dcp_metadata(path)
        except CheckpointError as error:
            assert "\n" not in str(error) and path in str(error)


@fuzz_settings(25)
@given(edits=EDITS, cut=st.integers(-40, 4), shard_edits=EDITS)
def test_torch_dist_load_of_mutated_metadata_and_shards(edits, cut, shard_edits) -> None:
    """A mutated (but still unpicklable) .metadata or shard either loads the exact values or
    fails with CheckpointError: never another exception, never a wrong shape."""
    files = dict(checkpoint())
    files[DCP_METADATA] = mutate(files[DCP_METADATA], edits, cut)
    files["__0_0.distcp"] = mutate(files["__0_0.distcp"], shard_edits, 0)
    with tempfile.TemporaryDirectory() as directory:
        _materialise(directory, files)
        out = torch.full(SHAPE, -1.0)
        step = torch.zeros(())
        destination = {"w": [TensorShard(out, (0, 0), SHAPE)],
                       "step": [TensorShard(step, (), ())]}  # fmt: skip
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_sharded(directory, destination, group=None, require_checksums=False)
        except CheckpointError as error:
            assert "\n" not in str(error)
            return
        if not edits and not cut and not shard_edits:  # untouched: the saved values, exactly
            assert torch.equal(out, torch.arange(24.0).reshape(SHAPE)) and float(step) == 3


@fuzz_settings(100)
@given(edits=EDITS, cut=st.integers(-600, 8))
def test_weights_only_torch_files(edits, cut) -> None:
    data = mutate(checkpoint()["legacy.pt"], edits, cut)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model_optim_rng.pt")
        Path(path).write_bytes(data)
        try:
            safe_torch_load(path)
        except CheckpointError as error:
            assert "\n" not in str(error) and path in str(error)


# --- the argument parser --------------------------------------------------------------------

_ACTIONS = [a for a in build_parser()._actions if a.option_strings and "-h" not in a.option_strings]
INTS = st.sampled_from([0, 1, 2, 3, 4, 8, -1, 10**6, 2**63]).map(str)
FLOATS = st.sampled_from(["0", "1", "-1", "0.5", "1e-3", "nan", "inf", "-inf", "1e308"])
WORDS = st.sampled_from(["x", "", "1", "0.3 A 0.7", "969,30,1", "..", "auto", "A B"])


def _values(action) -> st.SearchStrategy[list[str]]:
    if action.nargs == 0:
        return st.just([])
    if action.choices:
        one = st.sampled_from([str(c) for c in action.choices]) | WORDS
    elif action.type is int:
        one = INTS
    elif action.type is float:
        one = FLOATS
    else:
        one = WORDS
    if isinstance(action.nargs, int):
        return st.lists(one, min_size=action.nargs, max_size=action.nargs)
    if action.nargs in ("*", "+"):
        return st.lists(one, min_size=0, max_size=3)
    return one.map(lambda value: [value])


FLAG = st.sampled_from(_ACTIONS).flatmap(
    lambda action: _values(action).map(lambda values: [action.option_strings[0], *values])
)


@fuzz_settings(60)
@given(flags=st.lists(FLAG, min_size=1, max_size=4), world_size=st.sampled_from([1, 2, 4, 8]))
def test_argument_parser(flags: list[list[str]], world_size: int, tmp_path_factory) -> None:
    cwd = tmp_path_factory.getbasetemp()  # relative paths among the values land here
    extra = [token for flag in flags for token in flag]
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parse_args(tiny_argv() + extra, world_size)
    except ConfigError as error:
        assert str(error) and "\n" not in str(error), extra
    finally:
        os.chdir(here)
