"""tools/generate_text.py's tokenizer: the checkpoint's by default, from any directory (the run
records its tokenizer files as absolute paths); a flag overriding one file of it keeps its
type (never a silent switch to NullTokenizer); a missing file is named with where its path
came from and the flag that replaces it."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

import pytest

from megapipe.checkpointing.hf_tokenizer import SavedTokenizer
from megapipe.checkpointing.torch_dist import load_common
from megapipe.checkpointing.tracker import iteration_dir
from megapipe.inference.generation import GenerationError
from megapipe.inference.session import TOKENIZER_FLAGS, session_tokenizer_spec
from tests.helpers import MODEL, NO_DROPOUT, run

ROOT = Path(__file__).resolve().parent.parent
SP = "GPTSentencePieceTokenizer"
NONE = SavedTokenizer(None, None, None, None, None)


def _generate_tool():
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools/generate_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flags(**given: object) -> argparse.Namespace:
    return argparse.Namespace(**{name: given.get(name) for name in TOKENIZER_FLAGS})


def test_tokenizer_model_alone_keeps_the_checkpoints_type() -> None:
    saved = SavedTokenizer(SP, "/gone/tok.model", None, None, None)
    spec = session_tokenizer_spec(_flags(tokenizer_model="here/tok.model"), saved)
    assert (spec.tokenizer_type, spec.tokenizer_model) == (SP, "here/tok.model")


def test_tokenizer_model_alone_without_a_type_to_keep_says_what_is_missing() -> None:
    with pytest.raises(GenerationError, match="takes no model file; add --tokenizer-type"):
        session_tokenizer_spec(_flags(tokenizer_model="tok.model"), NONE)


def test_no_tokenizer_anywhere_is_token_ids() -> None:
    assert session_tokenizer_spec(_flags(), NONE) is None


def test_a_missing_saved_file_is_named_with_where_it_came_from(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    gone = str(tmp_path / "gone.model")
    with pytest.raises(GenerationError) as error:
        session_tokenizer_spec(_flags(), SavedTokenizer(SP, gone, None, None, None))
    assert str(error.value) == (
        f"the checkpoint's tokenizer model {gone} (saved by the training run) is missing; "
        "pass --tokenizer-model PATH"
    )
    with pytest.raises(GenerationError) as error:  # an older checkpoint: a relative path
        session_tokenizer_spec(_flags(), SavedTokenizer(SP, "runs/tok.model", None, None, None))
    assert "runs/tok.model (saved by the training run, relative to the directory it was " in str(
        error.value
    )
    assert f"is not under {tmp_path}; pass --tokenizer-model PATH" in str(error.value)


def test_generation_works_from_any_directory(sp_model, tmp_path, monkeypatch, capsys) -> None:
    launch, elsewhere = tmp_path / "launch", tmp_path / "elsewhere"
    launch.mkdir()
    elsewhere.mkdir()
    shutil.copy(sp_model, launch / "tok.model")
    monkeypatch.chdir(launch)
    tokenizer = ["--tokenizer-type", SP, "--tokenizer-model", "tok.model"]  # relative, as users do
    run(1, [*MODEL, *NO_DROPOUT, "--mock-data", *tokenizer, "--train-iters", "2", "--save", "ckpt"])
    saved = load_common(iteration_dir(str(launch / "ckpt"), 2))["megapipe_args"]["tokenizer_model"]
    assert saved == repr(str(launch / "tok.model"))

    monkeypatch.chdir(elsewhere)
    tool = _generate_tool()
    argv = ["--load", str(launch / "ckpt"), "--prompt", "The", "--max-new-tokens", "2", "--greedy"]
    assert tool.main(argv) == 0, capsys.readouterr().err
    (launch / "tok.model").rename(elsewhere / "moved.model")
    capsys.readouterr()
    assert tool.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"generate_text.py: error: the checkpoint's tokenizer model {launch / 'tok.model'} "
        "(saved by the training run) is missing; pass --tokenizer-model PATH"
    )
    # the flag alone: the checkpoint's SentencePiece type from the new place ("The" is no id)
    assert tool.main([*argv, "--tokenizer-model", "moved.model"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("The")


def test_a_missing_checkpoint_names_the_tools_own_flag(tmp_path, capsys) -> None:
    assert _generate_tool().main(["--load", str(tmp_path / "none"), "--prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--load {tmp_path / 'none'}: no such directory" in err and "--load-dir" not in err
