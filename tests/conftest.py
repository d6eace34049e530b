"""Shared, session-scoped data fixtures: a small real-English corpus (from Python's own pydoc
topics), a SentencePiece model trained on it, and the corpus preprocessed into .bin/.idx."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run on Triton's CPU interpreter, which must be switched on
# before Triton is first imported (tests/test_kernels_*.py; it is far too slow to train with).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def needs_cuda(item: pytest.Item) -> bool:
    """Whether a test is skipped where there is no CUDA device: a skipif whose reason names
    CUDA (its condition is an evaluated bool by now, so the reason's wording is the contract;
    "where CUDA is present" marks the opposite, a test of the CPU-only refusal)."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason and "present" not in reason:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `pytest -m cuda` (tools/gpu_check.sh's cuda-tests part) selects every test that CI skips
    # for want of a CUDA device, so that none is left out of the GPU check
    for item in items:
        if needs_cuda(item):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def demo_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megapipe.data.demo_corpus import demo_documents

    path = tmp_path_factory.mktemp("corpus") / "demo.jsonl"
    with open(path, "w", encoding="utf-8") as file:
        for document in demo_documents(docstrings=False):
            file.write(json.dumps(document) + "\n")
    return path


@pytest.fixture(scope="session")
def sp_model(demo_jsonl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megapipe.data.tokenizer_training import TokenizerTrainingOptions, train_sentencepiece

    prefix = tmp_path_factory.mktemp("tokenizer") / "demo"
    report = train_sentencepiece(
        TokenizerTrainingOptions(
            inputs=(str(demo_jsonl),), output_prefix=str(prefix), vocab_size=1000
        )
    )
    return Path(report.model_path)


@pytest.fixture(scope="session")
def demo_prefix(demo_jsonl: Path, sp_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo corpus preprocessed with --append-eod: PREFIX.bin/.idx."""
    from megapipe.data.preprocess import PreprocessOptions, preprocess
    from megapipe.data.tokenizers import TokenizerSpec

    out = tmp_path_factory.mktemp("preprocessed") / "demo"
    spec = TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(sp_model))
    report = preprocess(
        PreprocessOptions(str(demo_jsonl), str(out), spec, append_eod=True), show_progress=False
    )
    return report.outputs["text"]
