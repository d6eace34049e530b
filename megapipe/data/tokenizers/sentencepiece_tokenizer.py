"""SentencePiece models behind Megatron's two tokenizer types.

- `GPTSentencePieceTokenizer`: the model as it is; eod is the model's eos, pad its pad.
- `SentencePieceTokenizer`: Megatron's T5/BERT-style wrapper that also knows <CLS>, <SEP>,
  <EOD>, <MASK>, <PAD>, <BOS>, <EOS> (and <extra_id_N>): each maps to the model's piece of that
  name, or to a new id after the model's vocabulary; text is split around them before encoding,
  and eod is <EOD>.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import Tokenizer


def load_sentencepiece(path: str):
    """A SentencePieceProcessor for `path`, or a TokenizerError naming the file."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise TokenizerError(
            f"--tokenizer-model {path}: not a SentencePiece model ({reason})"
        ) from None


class GPTSentencePieceTokenizer(Tokenizer):
    """A SentencePiece model used as is: ids are the model's, eod is its eos id."""

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self._sp = load_sentencepiece(model_file)

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: parallelism is --workers' job (SentencePiece would use every core here).
        return self._sp.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def eod(self) -> int:
        eos = self._sp.eos_id()
        if eos < 0:
            raise TokenizerError(
                f"{self.model_file}: the SentencePiece model has no eos piece to use as eod "
                "(train it with eos_id >= 0, as tools/train_tokenizer.py does)"
            )
        return eos

    @property
    def pad(self) -> int:
        return self._sp.pad_id()


class SentencePieceTokenizer(Tokenizer):
    """Megatron's SentencePieceTokenizer: the model plus named special tokens."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        self.model_file = model_file
        self._sp = load_sentencepiece(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.vocab_size())}
        self._special: dict[str, int] = {}
        for name in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(name)
        self._pad = self._add_special(self._piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos = self._add_special(self._piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos = self._add_special(self._piece_or(self._sp.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            self._add_special(f"<extra_id_{i}>")
        self._inverse = {i: name for name, i in self._special.items()}

    def _piece_or(self, piece_id: int, default: str) -> str:
        return self._sp.id_to_piece(piece_id) if piece_id >= 0 else default

    def _add_special(self, name: str) -> int:
        if name not in self._vocab:
            self._vocab[name] = len(self._vocab)
        self._special[name] = self._vocab[name]
        return self._vocab[name]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Each named special token and its id, in the order they were added."""
        return dict(self._special)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            found = [(text.find(name, start), name) for name in self._special]
            found = [(at, name) for at, name in found if at >= 0]
            if not found:
                break
            at, name = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            ids.extend(self._sp.encode(text[start:at]))
            ids.append(self._special[name])
            start = at + len(name)
        ids.extend(self._sp.encode(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token in enumerate(ids):
            if token in self._inverse:
                text += self._sp.decode(ids[last:i]) + " " + self._inverse[token] + " "
                last = i + 1
        return text + self._sp.decode(ids[last:])

    @property
    def eod(self) -> int:
        return self._special["<EOD>"]

    @property
    def pad(self) -> int:
        return self._pad
