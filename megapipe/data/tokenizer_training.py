"""Train a SentencePiece BPE or unigram model for GPT from JSONL or plain text, offline.

The model reserves what a GPT needs: <unk> = 0, <s> (bos) = 1, </s> (eos, used as eod by
GPTSentencePieceTokenizer) = 2 and <pad> = 3, plus any user-defined symbols. Documents are fed
to the trainer line by line. The .model and .vocab appear only when training succeeded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

from megapipe.atomic_files import atomic_write
from megapipe.data.errors import DataError
from megapipe.data.input_issues import InputIssue, IssueLog
from megapipe.data.jsonl import decode_line, parse_json_line, read_chunks

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


@dataclass(frozen=True)
class TokenizerTrainingOptions:
    inputs: tuple[str, ...]
    output_prefix: str
    vocab_size: int = 32000
    model_type: str = "bpe"  # or "unigram"
    input_format: str = "auto"  # "jsonl", "text", or by file extension
    json_keys: tuple[str, ...] = ("text",)
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    user_defined_symbols: tuple[str, ...] = ()
    max_sentence_length: int = 16384
    input_sentence_size: int = 0  # 0: use every line; else sample this many
    num_threads: int = 2
    seed: int = 1234
    strict: bool = False


@dataclass
class TokenizerTrainingReport:
    model_path: str
    vocab_path: str
    sentences: int
    issues: list[IssueLog]


def _format(path: str, requested: str) -> str:
    if requested != "auto":
        return requested
    return "jsonl" if path.endswith((".jsonl", ".json", ".ndjson")) else "text"


def _sentences(path: str, options: TokenizerTrainingOptions, log: IssueLog) -> Iterator[str]:
    jsonl = _format(path, options.input_format) == "jsonl"
    for chunk in read_chunks(path, 4096, 1 << 22):
        for offset, raw in enumerate(chunk.lines):
            line = chunk.first_line + offset
            if jsonl:
                parsed = parse_json_line(raw, line, options.json_keys)
                if isinstance(parsed, InputIssue):
                    log.add(parsed)
                    continue
                texts = list(parsed.values())
                if not any(text.strip() for text in texts):
                    log.add(InputIssue(line, "empty document"))
                    continue
                for text in texts:
                    yield from (part for part in text.splitlines() if part.strip())
            else:
                text = decode_line(raw, line)
                if isinstance(text, InputIssue):
                    log.add(text)
                elif text.strip():
                    yield text


def train_sentencepiece(options: TokenizerTrainingOptions) -> TokenizerTrainingReport:
    """Train and write `{output_prefix}.model` and `.vocab` (piece, tab, score per line)."""
    import sentencepiece

    if options.model_type not in ("bpe", "unigram"):
        raise DataError(f"--model-type {options.model_type!r} is not one of bpe, unigram")
    if options.vocab_size < len(SPECIAL_IDS) + len(options.user_defined_symbols) + 1:
        raise DataError(f"--vocab-size {options.vocab_size} is too small")
    out_dir = os.path.dirname(os.path.abspath(options.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix {options.output_prefix}: no directory {out_dir}")
    logs = [IssueLog(path, options.strict) for path in options.inputs]
    counted = [0]
    failure: list[DataError] = []  # raised inside the trainer's C++ loop; re-raised below

    def sentences() -> Iterator[str]:
        try:
            for path, log in zip(options.inputs, logs):
                for sentence in _sentences(path, options, log):
                    counted[0] += 1
                    yield sentence
        except DataError as error:
            failure.append(error)

    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(options.seed)  # for --input-sentence-size sampling
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=options.vocab_size,
            model_type=options.model_type,
            character_coverage=options.character_coverage,
            byte_fallback=options.byte_fallback,
            user_defined_symbols=list(options.user_defined_symbols),
            max_sentence_length=options.max_sentence_length,
            input_sentence_size=options.input_sentence_size,
            shuffle_input_sentence=options.input_sentence_size > 0,
            num_threads=options.num_threads,
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except RuntimeError as error:
        if failure:
            raise failure[0] from None
        if counted[0] == 0:
            raise DataError(f"no training text in {', '.join(options.inputs)}") from None
        reason = str(error).strip().splitlines()[-1]
        raise DataError(f"SentencePiece training failed: {reason}") from None
    if failure:
        raise failure[0]
    data = model.getvalue()
    processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    model_path, vocab_path = options.output_prefix + ".model", options.output_prefix + ".vocab"
    with atomic_write(model_path) as temp:
        temp.write_bytes(data)
    with atomic_write(vocab_path) as temp:
        temp.write_text(
            "".join(
                f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
                for i in range(processor.vocab_size())
            ),
            encoding="utf-8",
        )
    return TokenizerTrainingReport(model_path, vocab_path, counted[0], logs)
