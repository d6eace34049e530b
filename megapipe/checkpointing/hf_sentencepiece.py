"""A run's SentencePiece model as a Hugging Face `tokenizer.json` that gives megapipe's ids.

megapipe encodes with the model's plain `SentencePieceProcessor.encode` (no BOS or EOS);
Megatron's `SentencePieceTokenizer` also splits the text around its named special tokens
(<CLS> <SEP> <EOD> <MASK>, the pad/bos/eos pieces, <extra_id_N>) first and encodes each part
alone. transformers' Llama tokenizer does neither the same way (a BOS, its own leading-space
and whitespace rules), so the model is rebuilt with the `tokenizers` library, following its
own settings as SentencePiece applies them:

- normalizer: the model's precompiled character map (e.g. nmt_nfkc), then, when it removes
  extra whitespace, leading/trailing spaces stripped and runs of spaces collapsed (spaces only:
  SentencePiece leaves newlines to the map), spaces escaped as "▁";
- a "▁" prepended to each part (Metaspace; an input "▁" at the start is doubled first, since
  Metaspace would otherwise skip the prefix where SentencePiece does not);
- BPE with merges ranked by piece score over normal pieces, or Unigram with the pieces'
  scores; byte fallback as the model has it; user-defined pieces split out whole;
- added tokens: none for `GPTSentencePieceTokenizer` (its control pieces are spelled out as
  text, as SentencePiece does: `split_special_tokens`), megapipe's special tokens at megapipe's
  ids for `SentencePieceTokenizer`.

Tested against SentencePiece on varied text (leading, repeated and trailing spaces, newlines,
tabs, unicode, digits, control pieces spelled out, user-defined pieces): BPE models give the same
ids for all of it. Where ids can differ, the export line says so: Unigram models where two
segmentations score exactly the same (ties broken otherwise, e.g. in runs of one repeated
character) and where the text spells a control or byte piece ("</s>", "<0x41>"), which
SentencePiece never matches. (A model trained without remove_extra_whitespaces, which megapipe's
trainer never does, also differs on CR LF: the `tokenizers` character map reads it as one
character.) Before writing, both encode a probe text, a guard against options not followed here.
The model proto is read by the small protobuf reader below, so neither `protobuf` nor
`transformers` is needed at export; `tokenizers` is (megapipe's "hf" extra).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType
UNIGRAM_CAVEAT = (
    "Unigram model: ids can differ from SentencePiece's where two segmentations tie (runs of "
    "one repeated character) or the text spells a control or byte piece"
)


@dataclass
class SentencePieceModel:
    """What encoding needs from a SentencePiece ModelProto (protobuf defaults applied)."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # piece, score, type
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_piece: str = "<unk>"
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = data[i : i + size], i + size
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i : i + size], i + size
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield number, value


def read_model(data: bytes) -> SentencePieceModel:
    """Parse a SentencePiece `.model` file's bytes (ValueError when it is not one)."""
    model = SentencePieceModel()
    for number, value in _fields(data):
        if number == 1:  # SentencePiece piece = 1, score = 2, type = 3
            piece, score, kind = "", 0.0, NORMAL
            for n, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            model.pieces.append((piece, score, kind))
        elif number == 2:  # TrainerSpec
            for n, v in _fields(value):
                if n == 3:
                    model.model_type = v
                elif n == 24:
                    model.treat_whitespace_as_suffix = bool(v)
                elif n == 35:
                    model.byte_fallback = bool(v)
                elif n == 45:
                    model.unk_piece = v.decode("utf-8")
        elif number == 3:  # NormalizerSpec
            for n, v in _fields(value):
                if n == 2:
                    model.precompiled_charsmap = bytes(v)
                elif n == 3:
                    model.add_dummy_prefix = bool(v)
                elif n == 4:
                    model.remove_extra_whitespaces = bool(v)
                elif n == 5:
                    model.escape_whitespaces = bool(v)
    if not model.pieces:
        raise ValueError("no pieces")
    return model


def build_tokenizer(model: SentencePieceModel, specials: dict[str, int] | None = None):
    """A `tokenizers.Tokenizer` that encodes as the SentencePiece model does; `specials`
    (name -> id, in megapipe's order) are split out of the text first, as added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE as BPEModel
    from tokenizers.models import Unigram

    user_defined = [p for p, _, kind in model.pieces if kind == USER_DEFINED]
    if model.model_type == BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(model.pieces)}
        normal = {p: (s, i) for i, (p, s, kind) in enumerate(model.pieces) if kind == NORMAL}
        ranked = sorted(
            (-score, i, piece[:cut], piece[cut:])
            for piece, (score, i) in normal.items()
            for cut in range(1, len(piece))
            if piece[:cut] in normal and piece[cut:] in normal
        )
        tokenizer = Tokenizer(
            BPEModel(
                vocab=vocab,
                merges=[(left, right) for _, _, left, right in ranked],
                unk_token=model.unk_piece,
                fuse_unk=True,
                byte_fallback=model.byte_fallback,
                ignore_merges=bool(user_defined),  # isolated user-defined pieces stay whole
            )
        )
    else:
        unk = next((i for i, (_, _, kind) in enumerate(model.pieces) if kind == UNKNOWN), 0)
        vocab_scores = [(piece, score) for piece, score, _ in model.pieces]
        tokenizer = Tokenizer(Unigram(vocab_scores, unk_id=unk, byte_fallback=model.byte_fallback))
    steps = []
    if model.precompiled_charsmap:
        steps.append(normalizers.Precompiled(model.precompiled_charsmap))
    if model.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if model.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if model.add_dummy_prefix:
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    splits = []
    if model.add_dummy_prefix:
        splits.append(
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
        )
    if user_defined:
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if splits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    steps = [decoders.Replace("▁", " ")]
    if model.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if model.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    for name, wanted in (specials or {}).items():
        tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if tokenizer.token_to_id(name) != wanted:
            raise ValueError(
                f"special token {name} got id {tokenizer.token_to_id(name)}, not {wanted}"
            )
    return tokenizer


# Encoded by both at export, a guard against model settings this rebuild does not follow.
PROBE = "Hello  world! 2024: ünïcode, 中文 and 🙂.\n\n New\tline  with  spaces. "


def write_sentencepiece_files(
    model_file: str,
    kind: str,
    save_dir: str,
    say: Callable[[str], None] = print,
    vocab_extra_ids: int = 0,
) -> str | None:
    """Write `tokenizer.json` + `tokenizer_config.json` for megapipe's tokenizer `kind` over
    `model_file`; returns the transformers class name, or None with a line saying why not."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        say(" no tokenizer files written: SentencePiece export needs the tokenizers package")
        return None
    from megapipe.data.errors import TokenizerError
    from megapipe.data.tokenizers import TokenizerSpec
    from megapipe.data.tokenizers import build_tokenizer as build_megapipe_tokenizer

    spec = TokenizerSpec(kind, tokenizer_model=model_file, vocab_extra_ids=vocab_extra_ids)
    try:
        ours = build_megapipe_tokenizer(spec)
        with open(model_file, "rb") as f:
            model = read_model(f.read())
    except TokenizerError as error:
        say(f" no tokenizer files written: {error}")
        return None
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as error:
        say(f" no tokenizer files written: {model_file} is not a SentencePiece model ({error})")
        return None
    if model.model_type not in (BPE, UNIGRAM) or model.treat_whitespace_as_suffix:
        say(
            f" no tokenizer files written: {model_file} is a SentencePiece model type or "
            "whitespace option this export does not rebuild (only BPE and Unigram with prefix "
            "spaces)"
        )
        return None
    try:
        eod = ours.eod
    except TokenizerError:
        eod = -1  # a model without an eos piece: no eos_token
    tokens = {"eos_token": eod, "pad_token": ours.pad}
    if kind == "SentencePieceTokenizer":
        specials = ours.special_tokens
        names = {i: name for name, i in specials.items()}
        config: dict[str, object] = {}
    else:  # its control pieces are text, as SentencePiece reads them
        specials = None
        names = {i: piece for i, (piece, _, _) in enumerate(model.pieces)}
        tokens["unk_token"] = next(
            (i for i, (_, _, t) in enumerate(model.pieces) if t == UNKNOWN), -1
        )
        config = {"split_special_tokens": True}
    config |= {key: names[i] for key, i in tokens.items() if i >= 0}
    tokenizer = build_tokenizer(model, specials)
    if tokenizer.encode(PROBE, add_special_tokens=False).ids != ours.tokenize(PROBE):
        say(
            f" no tokenizer files written: the tokenizer rebuilt from {model_file} gives other "
            "ids than SentencePiece (a normalizer or option this export does not follow)"
        )
        return None
    tokenizer.save(os.path.join(save_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        **config,
    }
    with open(os.path.join(save_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    caveat = f"; {UNIGRAM_CAVEAT}" if model.model_type == UNIGRAM else ""
    say(f" wrote PreTrainedTokenizerFast files ({kind} over {model_file}{caveat})")
    return "PreTrainedTokenizerFast"
