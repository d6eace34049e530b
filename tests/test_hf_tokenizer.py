"""An exported Hugging Face directory carries the run's tokenizer: `AutoTokenizer` gives the
same ids as megapipe's tokenizer for GPT-2 BPE files, for a tokenizer.json and for SentencePiece
models (both of Megatron's SentencePiece tokenizer types, BPE with and without user-defined
pieces on varied text; Unigram on the text without ties or spelled-out control pieces, the
caveat the export prints); runs without a tokenizer, or with one transformers would read
differently, get a line instead of files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megapipe.checkpointing.hf_sentencepiece import UNIGRAM_CAVEAT
from megapipe.checkpointing.hf_tokenizer import eod_id, write_tokenizer_files
from megapipe.data.tokenizer_training import TokenizerTrainingOptions, train_sentencepiece
from megapipe.data.tokenizers import TokenizerSpec, build_tokenizer
from tests.helpers import MODEL, NO_DROPOUT, convert_gpt, run

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


def test_the_eod_id_is_the_runs(trained: Path) -> None:
    vocab, merges = str(trained / "vocab.json"), str(trained / "merges.txt")
    args = {"tokenizer_type": "None", "vocab_file": repr(vocab), "merge_file": repr(merges)}
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    expected = json.loads((trained / "vocab.json").read_text())["<|endoftext|>"]
    assert eod_id(args, 600) == expected == build_tokenizer(spec).eod
    assert eod_id(args, expected) is None  # an id the model cannot write is no eos
    assert eod_id({"tokenizer_type": "None"}, 600) is None
    null = {"tokenizer_type": repr("NullTokenizer"), "vocab_size": "99"}
    assert eod_id(null, 100) == 99


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
         "--tokenizer-type SentencePieceTokenizer without --tokenizer-model"),
        ({"tokenizer_type": "'GPT2BPETokenizer'", "vocab_file": "'/gone/vocab.json'",
          "merge_file": "'/gone/merges.txt'"}, "/gone/vocab.json, /gone/merges.txt no longer"),
    ],
)  # fmt: skip
def test_no_files_but_a_line_when_nothing_would_tokenize_the_same(args, says, tmp_path) -> None:
    lines: list[str] = []
    assert write_tokenizer_files(args, str(tmp_path), lines.append) is None
    assert says in lines[0] and list(tmp_path.iterdir()) == []


# --- SentencePiece ---------------------------------------------------------------------------

VARIED = [
    "Hello world", " leading space", "   three leading spaces", "trailing spaces  ",
    "several     spaces   here", "line one\nline two", "para\n\nbreak", "\n starts with a newline",
    "tabs\tand\ttabs", "digits 1234567890, 3.14159 and 007", "unicode: ünïcode café naïve Ω≈ç√",
    "中文字符 and 日本語", "emoji 🙂🚀 done", "full width ＡＢＣ１２３ and the ﬁ ligature",
    "ideographic\u3000space", "▁ a literal metaspace, a▁b", "mixed\r\nline ends",
    "combining e\u0301", "", " ", "\n", "x", "  \n  ", TEXT,
]  # fmt: skip
SPELLED = ["</s> and <s> and <pad> and <unk>", "<0x41> is a byte piece's name"]
REPEATED = ["a row of stars: ********************* and ======================"]
NAMED = ["one<EOD>two", "<CLS> a <SEP> b<EOD><MASK>  c<extra_id_1>", "  <EOD>  ", "x</s>y<s>"]


def _sp_model(directory: Path, demo_jsonl: Path, name: str, **options) -> Path:
    report = train_sentencepiece(
        TokenizerTrainingOptions(
            inputs=(str(demo_jsonl),), output_prefix=str(directory / name), **options
        )
    )
    return Path(report.model_path)


def _identity_model(directory: Path, demo_jsonl: Path) -> Path:
    """No normalization and spaces kept as they are: the "▁" and leading-space paths."""
    import json

    import sentencepiece

    texts = [json.loads(line)["text"] for line in demo_jsonl.read_text().splitlines()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([p for t in texts for p in t.splitlines() if p.strip()]),
        model_prefix=str(directory / "identity"), vocab_size=800, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2,
    )  # fmt: skip
    return directory / "identity.model"


@pytest.fixture(scope="module")
def sp_models(sp_model: Path, demo_jsonl: Path, tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("sp")
    return {
        "bpe-identity": _identity_model(directory, demo_jsonl),
        "bpe": sp_model,
        "bpe-user-defined": _sp_model(
            directory, demo_jsonl, "ud", vocab_size=800, user_defined_symbols=("<|x|>", "@@")
        ),
        "unigram": _sp_model(directory, demo_jsonl, "uni", vocab_size=800, model_type="unigram"),
    }


def _export_sp(kind: str, model: Path, out: Path, extra: int = 0) -> tuple[object, object, str]:
    args = {"tokenizer_type": repr(kind), "tokenizer_model": repr(str(model))}
    if extra:
        args["vocab_extra_ids"] = repr(extra)
    out.mkdir()
    lines: list[str] = []
    assert write_tokenizer_files(args, str(out), lines.append) == "PreTrainedTokenizerFast", lines
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    spec = TokenizerSpec(kind, tokenizer_model=str(model), vocab_extra_ids=extra)
    return transformers.AutoTokenizer.from_pretrained(str(out)), build_tokenizer(spec), lines[0]


def _mismatches(theirs, ours, texts: list[str]) -> list[tuple]:
    return [
        (text, special, theirs(text, add_special_tokens=special)["input_ids"], ours.tokenize(text))
        for text in texts
        for special in (False, True)
        if theirs(text, add_special_tokens=special)["input_ids"] != ours.tokenize(text)
    ]


@pytest.mark.parametrize("model", ["bpe", "bpe-identity", "bpe-user-defined", "unigram"])
@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_sentencepiece_models_tokenize_as_megapipe_does(kind, model, sp_models, tmp_path):
    extra = 2 if kind == "SentencePieceTokenizer" else 0
    theirs, ours, line = _export_sp(kind, sp_models[model], tmp_path / "hf", extra)
    texts = VARIED + (NAMED if kind == "SentencePieceTokenizer" else [])
    if model.startswith("bpe"):
        texts += SPELLED + REPEATED
    if model == "bpe-identity":
        texts += ["▁x", "▁▁x", " ▁x", "<EOD>▁y"]
    if model == "bpe-user-defined":
        texts += ["a<|x|>b", " <|x|> c@@d", "<|x|><|x|>@@", "the<|x|>the"]
    assert _mismatches(theirs, ours, texts) == []
    assert sum(len(ours.tokenize(t)) for t in texts) > 200
    assert (UNIGRAM_CAVEAT in line) == (model == "unigram"), line
    assert theirs.eos_token_id == ours.eod and theirs.pad_token_id == ours.pad
    assert len(theirs) == ours.vocab_size
    if kind == "GPTSentencePieceTokenizer":  # decoding too
        for text in VARIED:
            assert theirs.decode(ours.tokenize(text)) == ours.detokenize(ours.tokenize(text))


def test_a_broken_sentencepiece_model_gets_a_line(tmp_path) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    (tmp_path / "hf").mkdir()
    lines: list[str] = []
    args = {"tokenizer_type": "'GPTSentencePieceTokenizer'", "tokenizer_model": repr(str(bad))}
    assert write_tokenizer_files(args, str(tmp_path / "hf"), lines.append) is None
    assert "not a SentencePiece model" in lines[0] and str(bad) in lines[0]
    assert list((tmp_path / "hf").iterdir()) == []


def test_an_exported_sentencepiece_run_loads_with_its_tokenizer(sp_model, tmp_path) -> None:
    """End to end: a run trained with the SentencePiece tokenizer, exported by the tool."""
    tokenizer = [
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        str(sp_model),
    ]
    run(1, MODEL + NO_DROPOUT + ["--mock-data", *tokenizer, "--train-iters", "1",
                                 "--save", str(tmp_path / "ckpt")])  # fmt: skip
    assert convert_gpt("--saver", "hf", "--load-dir", str(tmp_path / "ckpt"),
                "--save-dir", str(tmp_path / "hf")) == 0  # fmt: skip
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ours = build_tokenizer(
        TokenizerSpec("GPTSentencePieceTokenizer", tokenizer_model=str(sp_model))
    )
    assert theirs(TEXT)["input_ids"] == ours.tokenize(TEXT)
    assert model.config.vocab_size == len(theirs) == ours.vocab_size
