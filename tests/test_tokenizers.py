"""Every --tokenizer-type behind one interface, loaded from local files only, with errors that
name the missing or broken file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers import TokenizerSpec, build_tokenizer, gpt2_bpe

TEXT = "Hello world!  It's 2024: ünïcode, 中文 and 🙂 too.\n\nNew paragraph\twith tabs."


def texts(demo_jsonl: Path, count: int = 12) -> list[str]:
    lines = demo_jsonl.read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line)["text"] for line in lines] + [TEXT, "", " ", "a"]


def sp(kind: str, model: Path):
    return build_tokenizer(TokenizerSpec(kind, tokenizer_model=str(model)))


def test_gpt_sentencepiece_is_the_model_as_is(sp_model: Path, demo_jsonl: Path) -> None:
    tok = sp("GPTSentencePieceTokenizer", sp_model)
    raw = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert tok.vocab_size == raw.vocab_size() == 1000
    assert (tok.eod, tok.pad) == (2, 3)  # </s> and <pad>, as tools/train_tokenizer.py reserves
    sample = texts(demo_jsonl)
    assert tok.tokenize_batch(sample) == [tok.tokenize(t) for t in sample]
    for text in sample:
        ids = tok.tokenize(text)
        assert ids == raw.encode(text) and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == raw.decode(ids)
    assert (
        tok.detokenize(tok.tokenize(TEXT))
        == "Hello world! It's 2024: ünïcode, 中文 and 🙂 too. New paragraph with tabs."
    )


def test_megatron_sentencepiece_adds_named_special_tokens(sp_model: Path) -> None:
    tok = build_tokenizer(
        TokenizerSpec("SentencePieceTokenizer", tokenizer_model=str(sp_model), vocab_extra_ids=2)
    )
    # <CLS> <SEP> <EOD> <MASK> and two extra ids are new; pad/bos/eos map to <pad> <s> </s>.
    assert tok.vocab_size == 1000 + 4 + 2
    assert tok.eod == 1002 and tok.pad == 3
    ids = tok.tokenize("one<EOD>two<MASK>")
    assert ids[-1] == 1003 and 1002 in ids
    assert tok.tokenize("one") + [1002] == ids[: ids.index(1002) + 1]
    assert tok.detokenize(ids).split() == ["one", "<EOD>", "two", "<MASK>"]
    assert tok.tokenize("<extra_id_1>") == [1005]


def test_null_tokenizer_reads_ids() -> None:
    tok = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert tok.vocab_size == 101 and tok.eod == 100 and tok.pad == -1
    assert tok.tokenize("3 1  4\n1") == [3, 1, 4, 1] and tok.tokenize("  ") == []
    assert tok.detokenize([5, 6]) == "5 6"
    with pytest.raises(TokenizerError, match="expects integers"):
        tok.tokenize("3 x")
    with pytest.raises(TokenizerError, match="outside 0..100"):
        tok.tokenize("101")


def write_tiny_gpt2(directory: Path) -> tuple[Path, Path]:
    """A hand-made byte-level BPE: all 256 byte symbols, then merges t+h, th+e, Ġ+the."""
    table = gpt2_bpe.bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for token in ("th", "the", "Ġthe", "<|endoftext|>"):
        vocab[token] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\nt h\nth e\nĠ the\n", encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


def gpt2(vocab: Path, merges: Path):
    return build_tokenizer(
        TokenizerSpec("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    )


def test_gpt2_bpe_applies_merges_by_rank(tmp_path: Path) -> None:
    tok = gpt2(*write_tiny_gpt2(tmp_path))
    the, space_the = 257, 258
    assert tok.vocab_size == 260 and tok.eod == 259
    assert tok.tokenize("the the") == [the, space_the]
    assert tok.tokenize("theme") == [the, ord("m"), ord("e")]
    assert tok.tokenize(" thethe") == [space_the, the]  # the pre-tokenizer keeps one word
    table = gpt2_bpe.bytes_to_unicode()
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("A")] == "A"
    for text in (TEXT, "", "\x00\x1f\x7f", "  multiple   spaces  "):
        assert tok.detokenize(tok.tokenize(text)) == text  # every byte has a token


def test_gpt2_bpe_matches_hugging_face_byte_level_bpe(tmp_path: Path, demo_jsonl: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    corpus = texts(demo_jsonl, 40)
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=600, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    tok = gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert tok.vocab_size == trainer.get_vocab_size() and tok.eod == 0
    for text in corpus:
        assert tok.tokenize(text) == trainer.encode(text).ids
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_pretokenizer_without_regex_module_matches(
    monkeypatch: pytest.MonkeyPatch, demo_jsonl: Path
) -> None:
    regex = pytest.importorskip("regex")
    text = "".join(texts(demo_jsonl, 5)) + "x² ⅷ ١٢٣ \u3000\x1c\u2028 Ǆ ǅ"
    with_regex = gpt2_bpe.pretokenizer()
    assert isinstance(with_regex, regex.Pattern)
    monkeypatch.setitem(sys.modules, "regex", None)  # `import regex` now fails
    gpt2_bpe.pretokenizer.cache_clear()
    try:
        fallback = gpt2_bpe.pretokenizer()
        assert not isinstance(fallback, regex.Pattern)
        assert fallback.findall(text) == with_regex.findall(text)
    finally:
        gpt2_bpe.pretokenizer.cache_clear()


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path: Path, demo_jsonl: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        texts(demo_jsonl, 20), vocab_size=500, special_tokens=["<pad>", "</s>"]
    )
    trainer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    tok = build_tokenizer(spec)
    assert tok.vocab_size == 500 and tok.eod == 1 and tok.pad == 0
    assert tok.tokenize(TEXT) == trainer.encode(TEXT).ids
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert tok.tokenize_batch([TEXT, "a"]) == [tok.tokenize(TEXT), tok.tokenize("a")]
    (tmp_path / "tokenizer_config.json").unlink()
    file_spec = TokenizerSpec(
        "HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")
    )
    assert build_tokenizer(file_spec).eod == 1  # found by name, </s>


def test_hugging_face_tokenizer_without_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match="needs the `tokenizers` package: pip install"):
        build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))


def error(spec: TokenizerSpec) -> str:
    with pytest.raises(TokenizerError) as info:
        build_tokenizer(spec)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_and_broken_files_are_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.model")
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        assert error(TokenizerSpec(kind, tokenizer_model=missing)) == (
            f"--tokenizer-model {missing}: no such file"
        )
        assert error(TokenizerSpec(kind)) == f"--tokenizer-type {kind} needs --tokenizer-model"
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 not a model")
    assert error(
        TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(garbage))
    ).startswith(f"--tokenizer-model {garbage}: not a SentencePiece model")
    vocab, merges = write_tiny_gpt2(tmp_path)
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=missing)
    assert error(spec) == f"--merge-file {missing}: no such file"
    assert "needs --vocab-file" in error(TokenizerSpec("GPT2BPETokenizer", merge_file=str(merges)))
    vocab.write_text('{"a": 0,\n "b": }')
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert error(spec).startswith(f"--vocab-file {vocab}:2: not a JSON vocabulary")
    write_tiny_gpt2(tmp_path)
    merges.write_text("#version: 0.2\nt h\nbad line here\n")
    assert error(spec).startswith(f"--merge-file {merges}:3: expected two symbols")
    assert error(TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))).endswith(
        "directory has no tokenizer.json"
    )
    assert "needs --vocab-size" in error(TokenizerSpec("NullTokenizer"))
    assert "'BertTokenizer' is not one of" in error(TokenizerSpec("BertTokenizer"))


def test_sentencepiece_without_eos_has_no_eod(tmp_path: Path, demo_jsonl: Path) -> None:
    prefix = tmp_path / "noeos"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts(demo_jsonl, 10)),
        model_prefix=str(prefix),
        vocab_size=200,
        eos_id=-1,
        minloglevel=2,
    )
    tok = sp("GPTSentencePieceTokenizer", Path(f"{prefix}.model"))
    with pytest.raises(TokenizerError, match="has no eos piece"):
        _ = tok.eod
