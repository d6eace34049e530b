"""tools/preprocess_data.py, train_tokenizer.py, merge_datasets.py and make_demo_corpus.py:
outputs in Megatron's format and names, identical for 1 and 2 workers, bad input lines skipped
and reported by line number (fatal with --strict), and never a half-written output."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from megapipe.data.document_encoder import EncodeSettings, encode_chunk
from megapipe.data.errors import DataError
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.indexed_format import HEADER
from megapipe.data.jsonl import LineChunk, read_chunks
from megapipe.data.preprocess import PreprocessOptions, preprocess
from megapipe.data.progress import Progress
from megapipe.data.sentences import split_sentences
from megapipe.data.tokenizers import TokenizerSpec

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

import make_demo_corpus  # noqa: E402
import merge_datasets  # noqa: E402
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

BAD_LINES = [
    (b"this is not json\n", "malformed JSON"),
    (b'{"text": ""}\n', "empty document"),
    (b'{"body": "no text key"}\n', "missing key"),
    (b'{"text": "caf\xe9 latin-1"}\n', "invalid UTF-8"),
    (b"\n", "blank line"),
    (b'["a", "list"]\n', "not a JSON object"),
    (b'{"text": 42}\n', "not a string"),
]


def spec(model: Path) -> TokenizerSpec:
    return TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(model))


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=120
    )


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_output_is_the_tokenized_documents_with_eod(demo_jsonl, sp_model, demo_prefix) -> None:
    assert demo_prefix.endswith("_text_document")
    ds = IndexedDataset(demo_prefix)
    raw = Path(f"{demo_prefix}.idx").read_bytes()
    assert HEADER.unpack(raw[:34])[2] == 8  # uint16 code for a 1000-entry vocabulary
    processor = spm.SentencePieceProcessor(model_file=str(sp_model))
    docs = [json.loads(line)["text"] for line in demo_jsonl.read_text().splitlines()]
    assert ds.num_documents == len(ds) == len(docs)
    for i, text in enumerate(docs):
        assert ds.document(i).tolist() == processor.encode(text) + [processor.eos_id()]


def test_two_workers_write_the_same_bytes(tmp_path, demo_jsonl, sp_model) -> None:
    outputs = []
    for workers in (1, 2):
        options = PreprocessOptions(
            str(demo_jsonl),
            str(tmp_path / f"w{workers}"),
            spec(sp_model),
            append_eod=True,
            workers=workers,
            chunk_lines=7,
        )
        prefix = preprocess(options, show_progress=False).outputs["text"]
        outputs.append([Path(f"{prefix}.{ext}").read_bytes() for ext in ("bin", "idx")])
    assert outputs[0] == outputs[1]
    assert files(tmp_path) == sorted(
        f"w{w}_text_document.{e}" for w in (1, 2) for e in ("bin", "idx")
    )


def write_with_bad_lines(path: Path, demo_jsonl: Path) -> list[int]:
    """A few good lines with each kind of bad line in between; returns the bad line numbers."""
    good = demo_jsonl.read_bytes().splitlines(keepends=True)[:6]
    lines, bad = [], []
    for i, (raw, _) in enumerate(BAD_LINES):
        lines.append(good[i % len(good)])
        lines.append(raw)
        bad.append(len(lines))
    path.write_bytes(b"".join(lines))
    return bad


def test_bad_lines_are_skipped_and_reported_by_line(tmp_path, demo_jsonl, sp_model) -> None:
    source = tmp_path / "mixed.jsonl"
    bad = write_with_bad_lines(source, demo_jsonl)
    options = PreprocessOptions(
        str(source), str(tmp_path / "out"), spec(sp_model), workers=2, chunk_lines=3
    )
    report = preprocess(options, show_progress=False)
    assert report.documents == len(BAD_LINES) and report.lines == 2 * len(BAD_LINES)
    assert report.issues.counts == {kind: 1 for _, kind in BAD_LINES}
    summary = report.issues.summary(report.lines)
    assert summary.startswith(f"{source}: skipped 7 of 14 lines: ")
    for line, (_, kind) in zip(bad, BAD_LINES):
        assert f"1 {kind} (line {line})" in summary
    assert IndexedDataset(report.outputs["text"]).num_documents == len(BAD_LINES)


def test_strict_fails_on_the_first_bad_line_and_writes_nothing(
    tmp_path, demo_jsonl, sp_model
) -> None:
    source = tmp_path / "mixed.jsonl"
    write_with_bad_lines(source, demo_jsonl)
    out = tmp_path / "out"
    out.mkdir()
    for workers in (1, 2):
        options = PreprocessOptions(
            str(source), str(out / "x"), spec(sp_model), workers=workers, strict=True
        )
        with pytest.raises(DataError) as info:
            preprocess(options, show_progress=False)
        assert str(info.value) == (
            f"{source}:2: malformed JSON: Expecting value at column 1 (--strict)"
        )
        assert files(out) == []  # not even temporary files


@pytest.mark.slow
def test_cli_exit_codes_and_one_line_errors(tmp_path, demo_jsonl, sp_model) -> None:
    source = tmp_path / "mixed.jsonl"
    write_with_bad_lines(source, demo_jsonl)
    tool = str(TOOLS / "preprocess_data.py")
    args = f"--input {source} --output-prefix {tmp_path / 'o'} --tokenizer-type "
    args += "GPTSentencePieceTokenizer --tokenizer-model"
    proc = run_tool(tool, *f"{args} {sp_model} --strict".split())
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"preprocess_data.py: error: {source}:2: malformed JSON: Expecting value at column 1 "
        "(--strict)"
    ]
    missing = tmp_path / "missing.model"
    proc = run_tool(tool, *f"{args} {missing}".split())
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"preprocess_data.py: error: --tokenizer-model {missing}: no such file"
    )
    proc = run_tool(tool, *f"{args} {sp_model} --append-eod --log-interval 2 --workers 2".split())
    assert proc.returncode == 0, proc.stderr
    assert "Processed 7 documents (" in proc.stderr and "docs/s" in proc.stderr
    assert "MB/s" in proc.stderr and "skipped 7 of 14 lines" in proc.stderr
    assert "wrote 7 documents" in proc.stdout
    assert files(tmp_path) == ["mixed.jsonl", "o_text_document.bin", "o_text_document.idx"]


def test_missing_input_and_output_directory_are_named(tmp_path, sp_model) -> None:
    with pytest.raises(DataError, match="no such input file"):
        preprocess(
            PreprocessOptions(str(tmp_path / "none.jsonl"), str(tmp_path / "o"), spec(sp_model))
        )
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match="--output-prefix .*: no directory"):
        preprocess(PreprocessOptions(str(source), str(tmp_path / "no" / "o"), spec(sp_model)))
    source.write_text('{"text": ""}\n')
    with pytest.raises(DataError, match="no usable documents; .*1 empty document"):
        preprocess(
            PreprocessOptions(str(source), str(tmp_path / "o"), spec(sp_model)), show_progress=False
        )
    assert files(tmp_path) == ["in.jsonl"]


def test_several_keys_stay_aligned(tmp_path, sp_model) -> None:
    source = tmp_path / "qa.jsonl"
    rows = [
        {"q": "What is a list?", "a": "A mutable sequence."},
        {"q": "Empty answer", "a": ""},
        {"q": "What is a tuple?", "a": "An immutable sequence."},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = PreprocessOptions(
        str(source), str(tmp_path / "qa"), spec(sp_model), json_keys=("q", "a")
    )
    report = preprocess(options, show_progress=False)
    q, a = IndexedDataset(report.outputs["q"]), IndexedDataset(report.outputs["a"])
    assert q.num_documents == a.num_documents == 2  # the row with an empty answer is dropped
    processor = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert a.document(1).tolist() == processor.encode("An immutable sequence.")


def test_split_sentences_writes_sentence_sequences(tmp_path, sp_model) -> None:
    source = tmp_path / "s.jsonl"
    text = "The first sentence is here. The second one follows! Is this the third? Yes."
    source.write_text(json.dumps({"text": text}) + "\n")
    options = PreprocessOptions(
        str(source), str(tmp_path / "s"), spec(sp_model), append_eod=True, split_sentences=True
    )
    prefix = preprocess(options, show_progress=False).outputs["text"]
    assert prefix.endswith("_text_sentence")
    ds = IndexedDataset(prefix)
    processor = spm.SentencePieceProcessor(model_file=str(sp_model))
    sentences = split_sentences(text)
    assert len(sentences) == 4 and ds.num_documents == 1 and len(ds) == 4
    for i, sentence in enumerate(sentences):
        expected = processor.encode(sentence) + ([2] if i == 3 else [])  # eod ends the document
        assert ds[i].tolist() == expected


def test_sentence_splitter_rules() -> None:
    text = "Dr. Smith met J. Doe. They talked, e.g. about Python. Really?\n\nnew paragraph"
    assert split_sentences(text) == [
        "Dr. Smith met J. Doe.",
        "They talked, e.g. about Python.",
        "Really?",
        "new paragraph",
    ]
    kept = split_sentences("One here. Two there.\nThree now.", keep_newlines=True)
    assert kept == ["One here. ", "Two there.\n", "Three now."] and "".join(kept).count("\n") == 1


def test_reading_is_chunked_and_bounded(tmp_path) -> None:
    source = tmp_path / "lines.txt"
    source.write_bytes(b"".join(b"x" * (i % 50) + b"\n" for i in range(1000)))
    chunks = list(read_chunks(str(source), max_lines=64, max_bytes=400))
    assert sum(len(c.lines) for c in chunks) == 1000
    assert all(len(c.lines) <= 64 and c.num_bytes < 400 + 51 for c in chunks)
    assert [c.first_line for c in chunks[:2]] == [1, 1 + len(chunks[0].lines)]


def test_encode_chunk_pins_tokenizer_errors_on_their_line() -> None:
    settings = EncodeSettings(
        TokenizerSpec("NullTokenizer", vocab_size=10), ("text",), "uint16", True
    )
    lines = [b'{"text": "1 2 3"}\n', b'{"text": "4 x"}\n', b'{"text": "99"}\n', b'{"text": "5"}\n']
    chunk = encode_chunk(settings, LineChunk(10, lines, 0))
    assert chunk.num_documents == 2
    assert [(i.line, i.kind) for i in chunk.issues] == [
        (11, "tokenizer error"),
        (12, "tokenizer error"),
    ]
    arrays = chunk.arrays["text"]
    assert arrays.tokens.tolist() == [1, 2, 3, 10, 5, 10] and arrays.tokens.dtype == np.uint16
    assert arrays.sequence_lengths.tolist() == [4, 2]


def test_progress_bar_and_log_lines_show_rates() -> None:
    stream = io.StringIO()
    progress = Progress(1000, log_interval=5, stream=stream, bar=True)
    progress.update(10, 500)
    progress.close()
    assert "docs/s" in stream.getvalue() and "B/s" in stream.getvalue()
    stream = io.StringIO()
    progress = Progress(1000, log_interval=5, stream=stream, bar=False)
    for _ in range(4):
        progress.update(3, 100)
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "Processed 6 documents",
        "Processed 12 documents",
    ]
    assert all("docs/s" in line and "MB/s" in line for line in lines)


def test_merging_halves_equals_preprocessing_the_whole(tmp_path, demo_jsonl, sp_model) -> None:
    lines = demo_jsonl.read_bytes().splitlines(keepends=True)
    (tmp_path / "parts").mkdir()
    tokenizer = f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {sp_model}"
    for name, part in (("a", lines[:30]), ("b", lines[30:])):
        (tmp_path / f"{name}.jsonl").write_bytes(b"".join(part))
        argv = f"--input {tmp_path / name}.jsonl --output-prefix {tmp_path / 'parts' / name} "
        assert preprocess_data.main(f"{argv} {tokenizer} --append-eod --quiet".split()) == 0
    argv = f"--input {tmp_path / 'parts'} --output-prefix {tmp_path / 'm'}"
    assert merge_datasets.main(argv.split()) == 0
    options = PreprocessOptions(
        str(demo_jsonl), str(tmp_path / "w"), spec(sp_model), append_eod=True
    )
    whole = preprocess(options, show_progress=False).outputs["text"]
    for ext in ("bin", "idx"):
        assert (tmp_path / f"m.{ext}").read_bytes() == Path(f"{whole}.{ext}").read_bytes()


@pytest.mark.slow
def test_train_tokenizer_tool(tmp_path, demo_jsonl) -> None:
    text = tmp_path / "plain.txt"
    docs = [json.loads(line)["text"] for line in demo_jsonl.read_text().splitlines()[:20]]
    text.write_bytes("\n".join(docs).encode() + b"\nbad \xff byte\n")
    prefix = tmp_path / "tok"
    argv = f"--input {text} --output-prefix {prefix} --vocab-size 500 --model-type unigram"
    assert train_tokenizer.main([*argv.split(), "--user-defined-symbols", "<|x|>"]) == 0
    processor = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    assert processor.vocab_size() == 500
    pieces = [processor.id_to_piece(i) for i in range(5)]
    assert pieces == ["<unk>", "<s>", "</s>", "<pad>", "<|x|>"]
    ids = (processor.unk_id(), processor.bos_id(), processor.eos_id(), processor.pad_id())
    assert ids == (0, 1, 2, 3)
    vocab_lines = Path(f"{prefix}.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 500 and vocab_lines[2].split("\t")[0] == "</s>"
    assert processor.decode(processor.encode("any ünïcode 中")) == "any ünïcode 中"  # byte fallback
    tool = str(TOOLS / "train_tokenizer.py")
    proc = run_tool(tool, *f"--input {text} --output-prefix {tmp_path / 'strict'} --strict".split())
    bad_line = text.read_bytes().count(b"\n")  # the last line
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"train_tokenizer.py: error: {text}:{bad_line}: invalid UTF-8: byte offset 4 in the line "
        "(--strict)"
    )
    assert not list(tmp_path.glob("strict*")) and not list(tmp_path.glob(".strict*"))
    argv = f"--input {text} --output-prefix {tmp_path / 'big'} --vocab-size 50000"
    with pytest.raises(DataError, match="SentencePiece training failed: .*size too high"):
        train_tokenizer.main(argv.split())
    assert not list(tmp_path.glob("big*"))


def test_demo_corpus_is_real_english_from_python_itself(tmp_path) -> None:
    out = tmp_path / "demo.jsonl"
    assert make_demo_corpus.main(["--output", str(out), "--max-mb", "0.55"]) == 0
    docs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    sources = {d["source"].split(":")[0] for d in docs}
    assert sources == {"pydoc_data.topics", "stdlib"}
    text = " ".join(d["text"] for d in docs)
    assert 0.55e6 <= len(text) < 0.9e6 and text.count(" the ") > 1000
    again = tmp_path / "again.jsonl"
    assert make_demo_corpus.main(["--output", str(again), "--max-mb", "0.55"]) == 0
    assert again.read_bytes() == out.read_bytes()  # deterministic
