"""Training on real data: the data flags, the vocabulary taken from the tokenizer, one-line
errors for bad data flags, and the same losses on one rank as on DP/TP/PP layouts."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (imported once here so forked ranks inherit it)

from megapipe.arguments import NO_DATASET, parse_args
from megapipe.errors import ConfigError
from megapipe.parallel import ParallelState
from megapipe.testing import run_distributed
from megapipe.training import train

MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip


def data_flags(demo_prefix: str, sp_model: Path, *extra: str) -> list[str]:
    tokenizer = [
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        str(sp_model),
    ]
    return ["--data-path", demo_prefix, *tokenizer, *extra]


def _train(rank: int, world_size: int, argv: list[str]) -> list[float]:
    configs = parse_args(argv, world_size)
    parallel = configs.parallel
    state = ParallelState.build(
        parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    )
    with contextlib.redirect_stdout(io.StringIO()):
        return [r.lm_loss for r in train(configs, state)]


def test_vocabulary_comes_from_the_tokenizer(demo_prefix, sp_model) -> None:
    configs = parse_args([*MODEL, "--train-iters", "2", *data_flags(demo_prefix, sp_model)], 1)
    assert configs.model.vocab_size == 1000 and configs.data.data_path == (demo_prefix,)
    assert configs.data.split == "969, 30, 1" and not configs.data.mock_data
    argv = [*MODEL, "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "300"]  # fmt: skip
    assert parse_args(argv, 1).model.vocab_size == 301  # NullTokenizer: ids and the eod


def error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args([*MODEL, "--train-iters", "2", *argv], 1)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_data_flags_are_one_line_errors(tmp_path, demo_prefix, sp_model) -> None:
    assert error([]) == NO_DATASET
    missing = str(tmp_path / "missing")
    assert error(data_flags(missing, sp_model)) == (
        f"{missing}.idx: no such file (the .idx of an indexed dataset)"
    )
    assert error(["--data-path", demo_prefix]) == (
        "--data-path needs --tokenizer-type (the vocabulary size comes from the tokenizer)"
    )
    flags = data_flags(demo_prefix, tmp_path / "nope.model")
    assert error(flags) == f"--tokenizer-model {tmp_path / 'nope.model'}: no such file"
    assert "leaves nothing for training" in error(
        data_flags(demo_prefix, sp_model, "--split", "0,1")
    )
    assert "cannot be combined" in error(data_flags(demo_prefix, sp_model, "--mock-data"))
    both = data_flags(demo_prefix, sp_model, "--train-data-path", demo_prefix)
    assert "--data-path and --train-data-path cannot be combined" in error(both)
    odd = data_flags(f"0.5 {demo_prefix} {demo_prefix}", sp_model)
    assert "'0.5' looks like a weight" in error(odd)
    (tmp_path / "file").write_text("x")
    cache = data_flags(demo_prefix, sp_model, "--data-cache-path", str(tmp_path / "file"))
    assert error(cache).endswith("exists and is not a directory")


def test_unused_flags_are_noted(demo_prefix, sp_model) -> None:
    argv = [*MODEL, "--train-iters", "2", "--train-data-path", demo_prefix, "--valid-data-path",
            demo_prefix, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
            str(sp_model), "--vocab-size", "50"]  # fmt: skip
    with pytest.warns(UserWarning):
        configs = parse_args(argv, 1)
    notes = " | ".join(configs.warnings)
    assert "--vocab-size (50) is ignored" in notes
    assert "--valid-data-path" not in notes  # it is read now, by evaluation


@pytest.fixture(scope="module")
def real_data_reference(demo_prefix, sp_model, tmp_path_factory) -> tuple[list[float], Path]:
    cache = tmp_path_factory.mktemp("cache")
    argv = [*MODEL, "--train-iters", "8", *data_flags(demo_prefix, sp_model, "--data-cache-path",
                                                      str(cache))]  # fmt: skip
    return run_distributed(_train, 1, argv)[0], cache


def test_training_on_real_data_learns_and_caches_indices(real_data_reference) -> None:
    losses, cache = real_data_reference
    assert len(losses) == 8 and abs(losses[0] - 6.9) < 0.5  # about ln(1000) at the start
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3
    assert len([p for p in cache.iterdir() if p.suffix == ".npy"]) == 3


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, []), (2, ["--tensor-model-parallel-size", "2"]),
     (2, ["--pipeline-model-parallel-size", "2"])],
    ids=["dp2", "tp2", "pp2"],
)  # fmt: skip
def test_layouts_read_the_same_samples(real_data_reference, demo_prefix, sp_model, world, layout):
    reference, cache = real_data_reference
    argv = [*MODEL, "--train-iters", "8", *layout,
            *data_flags(demo_prefix, sp_model, "--data-cache-path", str(cache))]  # fmt: skip
    for losses in run_distributed(_train, world, argv):
        assert losses == pytest.approx(reference, rel=1e-5)


@pytest.fixture(scope="module")
def short_documents(demo_jsonl, sp_model, tmp_path_factory) -> str:
    """The demo corpus cut into one-line documents, so that most samples hold an eod."""
    from megapipe.data.preprocess import PreprocessOptions, preprocess
    from megapipe.data.tokenizers import TokenizerSpec

    directory = tmp_path_factory.mktemp("short")
    lines = [line for doc in demo_jsonl.read_text().splitlines()
             for line in json.loads(doc)["text"].splitlines() if line.strip()]  # fmt: skip
    (directory / "short.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    spec = TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(sp_model))
    options = PreprocessOptions(
        str(directory / "short.jsonl"), str(directory / "short"), spec, append_eod=True
    )
    return preprocess(options, show_progress=False).outputs["text"]


def test_document_flags_change_the_loss_and_keep_parity(short_documents, sp_model) -> None:
    plain = [*MODEL, "--train-iters", "3", *data_flags(short_documents, sp_model)]
    flags = [*plain, "--eod-mask-loss", "--reset-position-ids"]
    reference = run_distributed(_train, 1, plain)[0]
    single = run_distributed(_train, 1, flags)[0]
    assert abs(single[0] - reference[0]) > 1e-4  # the eods are masked, positions restart
    for losses in run_distributed(_train, 2, flags):
        assert losses == pytest.approx(single, rel=1e-5)


def test_reset_attention_mask_changes_the_loss_and_keeps_parity(short_documents, sp_model):
    """Attention stays inside each document; every layout, middle pipeline stages included."""
    plain = [*MODEL, "--train-iters", "3", "--num-layers", "3",
             *data_flags(short_documents, sp_model), "--reset-position-ids"]  # fmt: skip
    masked = [*plain, "--reset-attention-mask"]
    reference = run_distributed(_train, 1, plain)[0]
    single = run_distributed(_train, 1, masked)[0]
    assert abs(single[0] - reference[0]) > 1e-4  # earlier documents are no longer visible
    for world, layout in ((2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                          (3, ["--pipeline-model-parallel-size", "3"])):  # fmt: skip
        for losses in run_distributed(_train, world, masked + layout):
            assert losses == pytest.approx(single, rel=1e-5)
