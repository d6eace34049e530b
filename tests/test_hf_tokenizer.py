"""An exported Hugging Face directory carries the run's tokenizer: `AutoTokenizer` gives the
same ids as megapipe's tokenizer for GPT-2 BPE files and for a tokenizer.json; runs without a
tokenizer, or with one transformers would read differently, get a line instead of files."""

from __future__ import annotations

from pathlib import Path

import pytest

from megapipe.checkpointing.hf_tokenizer import write_tokenizer_files
from megapipe.data.tokenizers import TokenizerSpec, build_tokenizer

transformers = pytest.importorskip("transformers")
TEXT = "The quick brown fox jumps over the lazy dog. Tokenizers: do they agree? 123 ... yes."


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_jsonl: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("bpe")
    lines = demo_jsonl.read_text().splitlines()[:60]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        lines, vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False
    )
    bpe.save_model(str(directory))
    bpe.save(str(directory / "tokenizer.json"))
    return directory


def _ids_after_export(args: dict[str, str], spec: TokenizerSpec, out: Path) -> tuple[list, list]:
    out.mkdir()
    lines: list[str] = []
    assert write_tokenizer_files(args, str(out), lines.append) is not None, lines
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    return exported.encode(TEXT, add_special_tokens=False), build_tokenizer(spec).tokenize(TEXT)


def test_gpt2_bpe_files_tokenize_as_megapipe_does(trained: Path, tmp_path: Path) -> None:
    vocab, merges = str(trained / "vocab.json"), str(trained / "merges.txt")
    args = {"tokenizer_type": "None", "vocab_file": repr(vocab), "merge_file": repr(merges)}
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    theirs, ours = _ids_after_export(args, spec, tmp_path / "hf")
    assert theirs == ours and len(ours) > 10


def test_a_tokenizer_json_tokenizes_as_megapipe_does(trained: Path, tmp_path: Path) -> None:
    path = str(trained / "tokenizer.json")
    args = {"tokenizer_type": repr("HuggingFaceTokenizer"), "tokenizer_model": repr(path)}
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=path)
    theirs, ours = _ids_after_export(args, spec, tmp_path / "hf")
    assert theirs == ours and len(ours) > 10


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"tokenizer_type": "None"}, "the run had no tokenizer"),
        ({"tokenizer_type": "'NullTokenizer'"}, "the run had no tokenizer"),
        ({"tokenizer_type": "'SentencePieceTokenizer'", "tokenizer_model": "None"},
         "SentencePiece export is not supported yet"),
        ({"tokenizer_type": "'GPT2BPETokenizer'", "vocab_file": "'/gone/vocab.json'",
          "merge_file": "'/gone/merges.txt'"}, "/gone/vocab.json, /gone/merges.txt no longer"),
    ],
)  # fmt: skip
def test_no_files_but_a_line_when_nothing_would_tokenize_the_same(args, says, tmp_path) -> None:
    lines: list[str] = []
    assert write_tokenizer_files(args, str(tmp_path), lines.append) is None
    assert says in lines[0] and list(tmp_path.iterdir()) == []
