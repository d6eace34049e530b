"""Validation and test batch sources: each split reads only its own documents (ranges worked
out by hand from the .idx document counts), blends and per-split paths follow train's rules,
batches do not depend on the layout reading them, and empty evaluation splits are one-line
errors up front."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.config import Configs
from megapipe.data.config_check import check_data_config
from megapipe.data.errors import DataError
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.mock import MockGPTDataset
from megapipe.data.sampler import micro_batch_range
from megapipe.data.sources import build_batch_sources
from megapipe.errors import ConfigError
from megapipe.testing import run_distributed

SEQ, GBS, MBS = 16, 8, 2
MODEL = [
    "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-iters", "2",
    "--lr", "1e-3",
]  # fmt: skip
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "20000"]


def write(path: Path, num_docs: int, base: int) -> str:
    """Documents of 5..24 tokens; token base + 100 * d + position + 1 names its document d."""
    rng = np.random.default_rng(num_docs + base)
    with IndexedDatasetBuilder(path, np.uint16) as builder:
        for d in range(num_docs):
            length = int(rng.integers(5, 25))
            builder.add_item([base + 100 * d + i + 1 for i in range(length)])
            builder.end_document()
    return str(path)


def idx_document_count(prefix: str) -> int:
    """Documents in PREFIX.idx, read from its 34-byte header (document_indices has one more)."""
    with open(f"{prefix}.idx", "rb") as file:
        header = file.read(34)
    assert header[:9] == b"MMIDIDX\x00\x00"
    return struct.unpack("<Q", header[26:34])[0] - 1


def documents(tokens: torch.Tensor, base: int = 0) -> set[int]:
    """The documents the tokens of some samples came from."""
    return set(((tokens - 1 - base) // 100).flatten().tolist())


def configs(*flags: str, world_size: int = 1) -> Configs:
    return parse_args([*MODEL, *flags], world_size)


def sources(configs: Configs, valid: int = 4 * GBS, test: int = 2 * GBS, train: int = 2 * GBS):
    return build_batch_sources(configs, train_samples=train, valid_samples=valid, test_samples=test)


def test_each_split_reads_its_own_document_range(tmp_path: Path) -> None:
    prefix = write(tmp_path / "a", 40, 0)
    assert idx_document_count(prefix) == 40
    # --split 80,15,5 of 40 documents: [0, 32), [32, 38), [38, 40) (round(0.8 * 40) = 32, ...)
    cache = tmp_path / "cache"
    flags = ["--data-path", prefix, "--split", "80,15,5", "--data-cache-path", str(cache)]
    built = sources(configs(*flags, *NULL_TOKENIZER))
    train = built.train.samples(range(2 * GBS))
    valid = built.valid.samples(range(4 * GBS))
    test = built.test.samples(range(2 * GBS))
    assert valid.shape == (4 * GBS, SEQ + 1) and train.shape == test.shape == (2 * GBS, SEQ + 1)
    assert documents(train) <= set(range(32))
    assert documents(valid) == set(range(32, 38))  # 32 samples cover the 6 documents
    assert documents(test) == {38, 39}
    splits = sorted(
        json.loads(p.read_text())["split"] for p in cache.glob("*-GPTDataset-description.json")
    )
    assert splits == ["test", "train", "valid"]  # each split caches its own indices

    # A split's shuffle depends on its own documents and size, not on the others.
    again = sources(configs(*flags, *NULL_TOKENIZER), train=7 * GBS)
    assert torch.equal(again.valid.samples(range(4 * GBS)), valid)
    batch = again.valid.batch(range(2, 4))
    assert torch.equal(batch.tokens, valid[2:4, :-1]) and torch.equal(batch.labels, valid[2:4, 1:])
    size = len(again.valid.dataset)
    with pytest.raises(DataError, match=f"valid sample {size} is beyond the {size} valid samples"):
        again.valid.samples([size])


def _read_eval_batches(rank: int, world_size: int, argv: list[str], tp: int) -> dict:
    built = sources(configs(*argv, world_size=world_size))
    dp_rank, dp = (rank // tp) % (world_size // tp), world_size // tp
    read = {}
    for name in ("test", "valid"):  # the other order from the single-rank read
        for iteration in (1, 0):
            for micro in range(GBS // dp // MBS):
                indices = micro_batch_range(
                    iteration,
                    micro,
                    global_batch_size=GBS,
                    micro_batch_size=MBS,
                    data_parallel_rank=dp_rank,
                    data_parallel_size=dp,
                )
                read[name, indices.start] = getattr(built, name).batch(indices).tokens
    return read


def test_eval_batches_do_not_depend_on_the_layout(tmp_path: Path) -> None:
    prefix = write(tmp_path / "a", 40, 0)
    argv = ["--data-path", prefix, "--split", "80,15,5", *NULL_TOKENIZER]
    whole = sources(configs(*argv))
    argv += ["--data-cache-path", str(tmp_path / "cache")]  # rank 0 builds, the others wait
    expected = {
        name: getattr(whole, name).batch(range(2 * GBS)).tokens for name in ("valid", "test")
    }
    tp2dp2 = run_distributed(_read_eval_batches, 4, argv + ["--tensor-model-parallel-size", "2"], 2)
    for rank, read in enumerate(tp2dp2):
        assert len(read) == 2 * 2 * 2  # splits x iterations x micro-batches of this DP rank
        for (name, start), tokens in read.items():
            assert torch.equal(tokens, expected[name][start : start + MBS]), (rank, name, start)
    assert tp2dp2[0].keys() == tp2dp2[1].keys() != tp2dp2[2].keys() == tp2dp2[3].keys()


def test_valid_split_of_a_weighted_blend(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a", 40, 0), write(tmp_path / "b", 60, 10000)
    assert (idx_document_count(a), idx_document_count(b)) == (40, 60)
    flags = ["--data-path", "1", a, "3", b, "--split", "80,15,5", *NULL_TOKENIZER]
    valid = sources(configs(*flags), valid=40).valid.samples(range(40))
    from_b = valid[:, 0] > 10000
    assert torch.equal((valid > 10000).all(dim=1), from_b)  # a sample stays in one dataset
    assert int(from_b.sum()) == 30  # 40 samples at weights 1/4, 3/4: 10 of A, 30 of B
    assert documents(valid[~from_b]) <= set(range(32, 38))  # A's valid: [32, 38) of 40
    assert documents(valid[from_b], base=10000) <= set(range(48, 57))  # B's: [48, 57) of 60


def test_per_split_paths_are_used_whole(tmp_path: Path) -> None:
    a, b, c = write(tmp_path / "a", 12, 0), write(tmp_path / "b", 5, 0), write(tmp_path / "c", 3, 0)
    flags = ["--train-data-path", a, "--valid-data-path", b, "--test-data-path", c]
    built = sources(configs(*flags, "--split", "1,0,0", *NULL_TOKENIZER))  # --split is ignored
    assert documents(built.valid.samples(range(4 * GBS))) == set(range(5))
    assert documents(built.test.samples(range(2 * GBS))) == set(range(3))
    alone = sources(configs("--train-data-path", a, *NULL_TOKENIZER))
    assert alone.valid is None and alone.test is None


def data_config(prefix: str, split: str):
    """The data flags alone (--eval-iters 0: start-up checks only the training split)."""
    return configs(
        "--data-path", prefix, "--split", split, "--eval-iters", "0", *NULL_TOKENIZER
    ).data


def test_empty_evaluation_split_is_a_one_line_error(tmp_path: Path) -> None:
    twenty = write(tmp_path / "twenty", 20, 0)
    data = data_config(twenty, "99,1,0")  # valid: [round(19.8), 20) = [20, 20)
    check_data_config(data)  # training alone does not need it
    expected = (
        f"--data-path {twenty}: the validation split holds 0 of 20 documents and 0 tokens "
        "(--split '99,1,0'); a GPT sample needs at least 2"
    )
    with pytest.raises(DataError) as info:
        check_data_config(data, needs_eval=True)
    assert str(info.value) == expected
    with pytest.raises(ConfigError) as config_info:  # pretrain_gpt.py refuses it at start-up
        configs("--data-path", twenty, "--split", "99,1,0", *NULL_TOKENIZER)
    assert str(config_info.value) == expected
    with pytest.raises(DataError) as info:  # and so does building the sources
        sources(configs("--data-path", twenty, "--split", "99,1,0", "--eval-iters", "0",
                        *NULL_TOKENIZER), valid=4 * GBS)  # fmt: skip
    assert str(info.value) == expected
    with pytest.raises(DataError, match=r"the test split holds 0 of 20 .*--split '90,9,1'"):
        check_data_config(data_config(twenty, "90,9,1"), needs_eval=True)  # test: [20, 20)


def test_zero_share_or_zero_samples_means_no_source(tmp_path: Path) -> None:
    hundred = write(tmp_path / "hundred", 100, 0)
    check_data_config(data_config(hundred, "98,2,0"), needs_eval=True)  # no test split: fine
    built = sources(configs("--data-path", hundred, "--split", "98,2,0", *NULL_TOKENIZER))
    assert built.test is None and documents(built.valid.samples(range(4 * GBS))) == {98, 99}
    none = sources(
        configs("--data-path", hundred, "--eval-iters", "0", *NULL_TOKENIZER), valid=0, test=0
    )
    assert none.valid is None and none.test is None and none.train is not None


def test_mock_eval_samples_differ_from_train() -> None:
    mock = ["--mock-data", "--vocab-size", "512"]
    built = sources(configs(*mock))
    train, valid, test = (
        getattr(built, n).batch(range(GBS)).tokens for n in ("train", "valid", "test")
    )
    assert not torch.equal(valid, train) and not torch.equal(test, valid)
    assert (valid[:, 0] != train[:, 0]).sum() >= GBS - 1  # random starts, not a shift
    assert torch.equal(((valid[:, 1:] - valid[:, :-1]) % 512), torch.ones(GBS, SEQ - 1).long())
    fresh = MockGPTDataset(512, SEQ, built.valid.seed, split="valid")  # stateless, any reader
    assert torch.equal(fresh.batch(range(3, 5)).tokens, valid[3:5])
    assert sources(configs(*mock), valid=0).valid is None
    assert sources(configs(*mock, "--split", "100,0,0")).valid is None
