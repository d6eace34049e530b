"""The tokenizer files of an exported Hugging Face directory, so `AutoTokenizer` loads the run's
tokenizer beside its model.

From the checkpoint's saved arguments: GPT-2 BPE (`--vocab-file`/`--merge-file`; also what
megapipe infers when no `--tokenizer-type` is given) becomes `vocab.json` + `merges.txt` with a
`GPT2Tokenizer` config; a Hugging Face `tokenizer.json` (`--tokenizer-model`, a file or a
directory) is copied as it is; a SentencePiece model (`GPTSentencePieceTokenizer`,
`SentencePieceTokenizer`) is rebuilt as a `tokenizer.json` that gives megapipe's ids
(`hf_sentencepiece`, which says where a Unigram model can differ). Anything else gets a line
saying why no files were written, never files that would tokenize differently.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from collections.abc import Callable
from typing import NamedTuple

EOD_TOKEN = "<|endoftext|>"


class SavedTokenizer(NamedTuple):
    """The tokenizer flags a run saved in its checkpoint (Megatron's inference included:
    vocab and merges files without a type mean GPT2BPETokenizer)."""

    kind: str | None
    model: str | None
    vocab: str | None
    merges: str | None
    vocab_size: int | None


def saved_tokenizer(args: dict[str, str]) -> SavedTokenizer:
    """The tokenizer flags of a checkpoint's saved arguments."""
    kind = saved_arg(args, "tokenizer_type")
    vocab, merges, model = (
        saved_arg(args, n) for n in ("vocab_file", "merge_file", "tokenizer_model")
    )
    if kind is None and vocab and merges:
        kind = "GPT2BPETokenizer"
    return SavedTokenizer(kind, model, vocab, merges, saved_arg(args, "vocab_size"))


def saved_arg(args: dict[str, str], name: str) -> object:
    """One saved argument's value (its repr read back), or None when it was not saved."""
    text = args.get(name)
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _copy(source: str, save_dir: str, name: str) -> None:
    shutil.copyfile(source, os.path.join(save_dir, name))


def eod_id(args: dict[str, str], vocab_size: int) -> int | None:
    """The run's end-of-document id (for config.json's eos_token_id, so that transformers'
    `generate` stops where megapipe's does), or None without a tokenizer that has one."""
    from megapipe.data.errors import TokenizerError
    from megapipe.data.tokenizers import TokenizerSpec, build_tokenizer

    kind, model, vocab, merges, vocab_size_flag = saved_tokenizer(args)
    if kind is None:
        return None
    spec = TokenizerSpec(kind, model, vocab, merges, vocab_size_flag)
    try:
        eod = build_tokenizer(spec).eod
    except (TokenizerError, OSError, ValueError):
        return None
    return eod if eod is not None and 0 <= eod < vocab_size else None


def write_tokenizer_files(
    args: dict[str, str], save_dir: str, say: Callable[[str], None] = print
) -> str | None:
    """Write the run's tokenizer into `save_dir`; returns its transformers class name, or None
    (with a line saying why) when there is nothing that transformers would read the same way."""
    kind, model, vocab, merges, _ = saved_tokenizer(args)
    missing = [p for p in (vocab, merges, model) if isinstance(p, str) and not os.path.exists(p)]
    if kind is None or kind == "NullTokenizer":
        say(" no tokenizer files written: the run had no tokenizer (mock data or NullTokenizer)")
        return None
    if missing:
        say(f" no tokenizer files written: {', '.join(missing)} no longer exist")
        return None
    if kind == "GPT2BPETokenizer":
        _copy(vocab, save_dir, "vocab.json")
        _copy(merges, save_dir, "merges.txt")
        with open(vocab, encoding="utf-8") as file:
            has_eod = EOD_TOKEN in json.load(file)
        special = {name: EOD_TOKEN for name in ("bos_token", "eos_token", "unk_token")}
        config = {"tokenizer_class": "GPT2Tokenizer", **(special if has_eod else {})}
        cls = "GPT2Tokenizer"
    elif kind == "HuggingFaceTokenizer":
        path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
        _copy(path, save_dir, "tokenizer.json")
        if os.path.isdir(model):
            for extra in ("tokenizer_config.json", "special_tokens_map.json"):
                if os.path.exists(os.path.join(model, extra)):
                    _copy(os.path.join(model, extra), save_dir, extra)
            if os.path.exists(os.path.join(model, "tokenizer_config.json")):
                say(f" wrote the tokenizer files of {model}")
                return "PreTrainedTokenizerFast"
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        cls = "PreTrainedTokenizerFast"
    elif kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        if not isinstance(model, str):
            say(f" no tokenizer files written: --tokenizer-type {kind} without --tokenizer-model")
            return None
        from megapipe.checkpointing.hf_sentencepiece import write_sentencepiece_files

        extra = saved_arg(args, "vocab_extra_ids") or 0
        return write_sentencepiece_files(model, kind, save_dir, say, vocab_extra_ids=extra)
    else:
        say(
            f" no tokenizer files written: --tokenizer-type {kind} has no transformers tokenizer "
            "that gives the same ids"
        )
        return None
    with open(os.path.join(save_dir, "tokenizer_config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    say(f" wrote {cls} files ({kind})")
    return cls
