"""What the generation tools share: their flags, and a loaded model with its tokenizer.

`tools/generate_text.py` and `tools/run_text_generation_server.py` take Megatron's flags for the
checkpoint (`--load`, `--ckpt-step`), the layout (`--tensor-model-parallel-size`,
`--pipeline-model-parallel-size`), precision (`--bf16`, `--fp16`) and the tokenizer
(`--tokenizer-type` and friends). The tokenizer flags default to those the checkpoint was
trained with, so `--load DIR` alone is enough. A run without a tokenizer (mock data) reads and
writes token ids, space-separated, as Megatron's NullTokenizer, and never stops at an EOD.

Generation runs without context parallelism: decoding steps of one token have no sequence to
split. `--context-parallel-size` is accepted at 1 (a training command line's flags carry over)
and any other size is refused in one line, before any rank joins a process group. Checkpoints
are layout-free, so one trained at any CP size loads here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from megapipe.checkpointing.hf_tokenizer import SavedTokenizer, saved_tokenizer
from megapipe.console import say
from megapipe.data.errors import TokenizerError
from megapipe.data.tokenizers.base import TOKENIZER_TYPES, Tokenizer, TokenizerSpec
from megapipe.data.tokenizers.factory import build_tokenizer
from megapipe.data.tokenizers.null_tokenizer import NullTokenizer
from megapipe.inference.generation import GenerationError
from megapipe.inference.loading import InferenceModel, load_inference_model
from megapipe.inference.sampling import SamplingOptions
from megapipe.parallel import ParallelState, initialize_distributed

TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--load, layout, precision and tokenizer flags (Megatron's names)."""
    group = parser.add_argument_group("model")
    group.add_argument("--load", required=True, help="Checkpoint directory (as for training).")
    group.add_argument("--ckpt-step", type=int, help="Iteration to load instead of the latest.")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Only 1: generation runs without context parallelism (a checkpoint trained at "
        "any context-parallel size loads).",
    )
    precision = group.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="Compute in bf16.")
    precision.add_argument("--fp16", action="store_true", help="Compute in fp16.")
    group.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    tokenizer = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    tokenizer.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    tokenizer.add_argument("--tokenizer-model")
    tokenizer.add_argument("--vocab-file")
    tokenizer.add_argument("--merge-file")
    tokenizer.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary size.")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """--greedy, --temperature, --top-k, --top-p, --seed."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--greedy", action="store_true", help="Always take the likeliest token.")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="Sample from the k likeliest.")
    group.add_argument("--top-p", type=float, default=0.0, help="Nucleus sampling (0: off).")
    group.add_argument("--seed", type=int, default=1234, help="Seed of the sampling stream.")


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    """The sampling flags as options; GenerationError naming the flag that is out of range."""
    options = SamplingOptions(args.greedy, args.temperature, args.top_k, args.top_p)
    problems = options.problems()
    if problems:
        raise GenerationError(problems[0])
    return options


@dataclass
class Session:
    """A loaded model on this rank with the tokenizer to talk to it."""

    model: InferenceModel
    tokenizer: Tokenizer
    eod: int | None  # None: never stop early

    @property
    def state(self) -> ParallelState:
        return self.model.state

    def tokenize(self, text: str, what: str = "prompt") -> list[int]:
        try:
            return self.tokenizer.tokenize(text)
        except TokenizerError as error:
            raise GenerationError(f"{what} {text[:40]!r}: {error}") from None


SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer")
MODEL_FILE_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer")


def session_tokenizer_spec(args: argparse.Namespace, saved: SavedTokenizer) -> TokenizerSpec | None:
    """The tokenizer to talk to the model with, or None for token ids (NullTokenizer at the
    model's vocabulary). Flags given override the checkpoint's one by one while they name the
    same type: `--tokenizer-model PATH` alone is the checkpoint's tokenizer type from PATH.
    GenerationError naming what is missing, and where a missing file's path came from."""
    given = SavedTokenizer(*(getattr(args, name) for name in TOKENIZER_FLAGS))
    kind = given.kind
    if kind is None and given.vocab and given.merges:
        kind = "GPT2BPETokenizer"
    if kind is None and given.model and saved.kind not in MODEL_FILE_TYPES:
        raise GenerationError(
            f"--tokenizer-model {given.model}: the checkpoint's tokenizer "
            f"({saved.kind or 'none'}) takes no model file; add --tokenizer-type "
            f"({', '.join(MODEL_FILE_TYPES)})"
        )
    one_of_two = (given.vocab is None) != (given.merges is None)
    if kind is None and one_of_two and saved.kind != "GPT2BPETokenizer":
        raise GenerationError("--vocab-file and --merge-file go together (GPT2BPETokenizer)")
    from_checkpoint = kind is None or kind == saved.kind  # its files, unless flags override
    if not from_checkpoint:
        _, model_file, vocab_file, merge_file, vocab_size = given
    else:
        kind = saved.kind
        model_file, vocab_file, merge_file, vocab_size = (
            mine if mine is not None else theirs for mine, theirs in zip(given[1:], saved[1:])
        )
        if kind in SENTENCEPIECE_TYPES and given.model is None:
            _require_saved(model_file, "tokenizer model", "--tokenizer-model")
        if kind == "GPT2BPETokenizer":
            if given.vocab is None:
                _require_saved(vocab_file, "vocab file", "--vocab-file")
            if given.merges is None:
                _require_saved(merge_file, "merge file", "--merge-file")
    if kind is None:  # trained without a tokenizer: token ids in, token ids out
        return None
    return TokenizerSpec(kind, model_file, vocab_file, merge_file, vocab_size)


def _require_saved(path: str | None, what: str, flag: str) -> None:
    """GenerationError when a file the checkpoint names is not there, saying where it came from."""
    if path is None or os.path.exists(path):
        return
    if os.path.isabs(path):
        missing = f"{path} (saved by the training run) is missing"
    else:  # an older checkpoint: the path as given at launch
        missing = (
            f"{path} (saved by the training run, relative to the directory it was launched "
            f"in) is not under {os.getcwd()}"
        )
    raise GenerationError(f"the checkpoint's {what} {missing}; pass {flag} PATH")


def build_session_tokenizer(
    args: argparse.Namespace, model: InferenceModel
) -> tuple[Tokenizer, int | None]:
    """The tokenizer the flags name, else the checkpoint's; and the EOD id to stop at."""
    vocab = model.config.vocab_size
    spec = session_tokenizer_spec(args, saved_tokenizer(model.args))
    if spec is None:
        return NullTokenizer(vocab), None
    kind = spec.tokenizer_type
    tokenizer = build_tokenizer(spec)
    if tokenizer.vocab_size > vocab:
        raise GenerationError(
            f"--tokenizer-type {kind}: its {tokenizer.vocab_size} ids do not fit the model's "
            f"vocabulary of {vocab}"
        )
    try:
        eod = tokenizer.eod
    except TokenizerError:
        eod = None
    return tokenizer, eod if eod is not None and 0 <= eod < vocab else None


def check_no_context_parallelism(size: int) -> None:
    """GenerationError naming --context-parallel-size unless it is 1."""
    if size != 1:
        raise GenerationError(
            f"--context-parallel-size {size}: generation runs without context parallelism "
            "(decoding steps of one token have no sequence to split); drop the flag, a "
            "checkpoint trained at any context-parallel size loads at TP x PP"
        )


def start_session(args: argparse.Namespace) -> Session:
    """Join the process group (torchrun's, or a one-rank one), build the layout's groups and
    load the model (collective). GenerationError first, with no process group joined, for a
    --context-parallel-size other than 1."""
    check_no_context_parallelism(args.context_parallel_size)
    device = initialize_distributed(args.distributed_backend)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = torch.distributed.get_world_size()
    if tp < 1 or pp < 1 or world != tp * pp:
        raise GenerationError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must "
            f"equal the number of ranks ({world})"
        )
    state = ParallelState.build(tp, pp, device)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    on_rank_0 = say if state.rank == 0 else (lambda _: None)
    model = load_inference_model(
        args.load, state, ckpt_step=args.ckpt_step, dtype=dtype, say=on_rank_0
    )
    tokenizer, eod = build_session_tokenizer(args, model)
    return Session(model, tokenizer, eod)
