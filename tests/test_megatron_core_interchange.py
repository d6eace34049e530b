"""Megatron-Core interchange: a GPT checkpoint written by Megatron-Core 0.16.1's
`dist_checkpointing.save(model.sharded_state_dict(), dir)` loads into megapipe with the same
logits, and one megapipe writes loads into Megatron-Core's `GPTModel` with the same logits.

Skipped unless `megatron-core` is installed (`pip install --no-deps megatron-core==0.16.1 psutil`;
its other requirements, torch, numpy and packaging, are megapipe's own). Megatron-Core runs on
CPU with gloo once three hard-coded CUDA calls are patched, in the forked rank only:
`torch.cuda.current_device()` (used as a `device=` argument by its memory buffer and by
dist_checkpointing's save finalisation), `torch.cuda.synchronize()` (its save's tensor preload)
and `CudaRNGStatesTracker.fork()` (entered around attention dropout even when it is 0). The
causal mask is passed explicitly (its default one is built on "cuda").

Megatron-Core loads the checkpoint of a megapipe training run (`--save`) with its WHOLE
`sharded_state_dict()`, nothing filtered, with a vocabulary that needs padding (100 real rows,
128 in the model, as Megatron-LM builds it), and `load_state_dict(strict=True)` takes the
model's part of what it read:
- megapipe writes the vocabulary tensors with the saving run's padded rows and reads only the
  real ones (`layout_free.fit_vocabulary`), so either side loads the other's padding;
- megapipe writes Megatron-Core's `_extra_state` byte entries (one per linear layer and layer
  index), byte for byte what Megatron-Core's local spec writes (`torch.save([None])`); megapipe
  never reads them;
- `common.pt`'s `args` is Megatron-LM's `argparse.Namespace` (megapipe's own strings are under
  `megapipe_args`); its entries are merged into the state dict Megatron-Core's load returns;
- Megatron-Core's `.metadata` also holds `all_local_plans` (DCP `SavePlan`s), allowed in
  safe_pickle.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's checkpoint writer needs it

from megapipe.arguments import parse_args  # noqa: E402
from megapipe.checkpointing.layout_free import fit_vocabulary, model_shards  # noqa: E402
from megapipe.checkpointing.torch_dist import load_sharded, read_metadata, sharded_keys  # noqa: E402
from megapipe.checkpointing.tracker import iteration_dir  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from megapipe.training.build import build_model_chunks_for  # noqa: E402
from tests.helpers import run  # noqa: E402

# megapipe's vocabulary of 100 is 128 rows in the model (--make-vocab-size-divisible-by 128)
LAYERS, HIDDEN, HEADS, VOCAB, PADDED, SEQ = 2, 64, 4, 100, 128, 16
ITERATIONS = 2
FLAGS = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
    "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
    "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data",
    "--train-iters", str(ITERATIONS), "--eval-iters", "0",
    "--lr", "1e-3", "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _patch_cuda_calls() -> None:
    """Megatron-Core's hard-coded CUDA calls, made CPU no-ops (in the forked rank only)."""
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _mcore_model(tied: bool, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=PADDED,  # Megatron-LM's padded_vocab_size
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="learned_absolute",
    )
    return model.eval()


def _mcore_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked
    with torch.no_grad():
        return model(tokens, positions, causal)[..., :VOCAB]  # [b, s, vocab]: the real columns


def _flags(tied: bool) -> list[str]:
    return FLAGS if tied else [*FLAGS, "--untie-embeddings-and-output-weights"]


def _megapipe_model(tied: bool):
    (model,) = build_model_chunks_for(parse_args(_flags(tied), 1), ParallelState.single())
    return model.eval()


def _load_into_megapipe(model, directory: str, require_checksums: bool = True) -> None:
    """megapipe's load of a checkpoint's model weights, as its loaders do it."""
    wanted = model_shards(list(model.named_parameters()), 0, 1, LAYERS, loading=True)
    load_sharded(
        directory, wanted, group=None, require_checksums=require_checksums, fit=fit_vocabulary
    )


def _byte_entries(directory: str) -> dict[str, bytes]:
    """Every byte entry of a torch_dist checkpoint, raw (read without unpickling)."""
    metadata = read_metadata(directory, require_checksums=False)
    out = {}
    for index, info in metadata.storage_data.items():
        if index.offset is None:  # a BYTE_IO item
            with open(os.path.join(directory, info.relative_path), "rb") as f:
                f.seek(info.offset)
                out[index.fqn] = f.read(info.length)
    return out


def _megapipe_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :VOCAB]  # [s, b, padded] -> [b, s, vocab]


def _interchange(
    rank: int, world_size: int, tied: bool, tmp: str, trained: str
) -> dict[str, object]:
    from megatron.core import dist_checkpointing, parallel_state

    _patch_cuda_calls()
    parallel_state.initialize_model_parallel(1, 1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out: dict[str, object] = {}

    # Megatron-Core -> megapipe
    mcore = _mcore_model(tied, seed=1)
    expected = _mcore_logits(mcore, tokens)
    from_mcore = os.path.join(tmp, "from_mcore")
    os.makedirs(from_mcore)
    dist_checkpointing.save(mcore.sharded_state_dict(), from_mcore)
    ours = _megapipe_model(tied)
    out["untrained"] = (_megapipe_logits(ours, tokens) - expected).abs().max().item()
    _load_into_megapipe(ours, from_mcore, require_checksums=False)  # 128 rows: reads 100
    out["mcore_to_megapipe"] = (_megapipe_logits(ours, tokens) - expected).abs().max().item()

    # megapipe -> Megatron-Core: the checkpoint of a megapipe training run, as it is
    ours = _megapipe_model(tied)
    _load_into_megapipe(ours, trained)
    expected = _megapipe_logits(ours, tokens)
    theirs = _mcore_model(tied, seed=2)
    out["untrained_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max().item()
    sharded = theirs.sharded_state_dict()  # the whole of it: _extra_state entries included
    state = dist_checkpointing.load(sharded, trained)
    theirs.load_state_dict({k: state[k] for k in sharded}, strict=True)
    out["megapipe_to_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max().item()
    out["unexpected"] = sorted(set(state) - set(sharded))  # common.pt's entries
    # the same byte entries as Megatron-Core's own, byte for byte
    out["extra_state_differs"] = _byte_entries(trained) != _byte_entries(from_mcore)
    out["extra_states"] = len(_byte_entries(trained))
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_checkpoints_move_between_megatron_core_and_megapipe(tied: bool, tmp_path) -> None:
    save = tmp_path / "megapipe"
    run(1, [*_flags(tied), "--save", str(save)])
    trained = iteration_dir(str(save), ITERATIONS)
    assert sharded_keys(trained)["embedding.word_embeddings.weight"] == (PADDED, HIDDEN)
    (diffs,) = run_distributed(_interchange, 1, tied, str(tmp_path), trained, timeout=240)
    print(diffs)
    # the comparisons see models that did not load
    assert diffs["untrained"] > 1e-2 and diffs["untrained_mcore"] > 1e-2, diffs
    assert diffs["mcore_to_megapipe"] < 1e-5, diffs
    assert diffs["megapipe_to_mcore"] < 1e-5, diffs
    assert diffs["extra_states"] == 4 * LAYERS and not diffs["extra_state_differs"], diffs
    assert "args" in diffs["unexpected"] and "checkpoint_version" in diffs["unexpected"], diffs

    # common.pt as Megatron-LM's loader reads it (plain torch.load)
    common = torch.load(os.path.join(trained, "common.pt"), weights_only=False)
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size) == (LAYERS, HIDDEN, PADDED)
    assert args.params_dtype == torch.float32 and args.iteration == ITERATIONS
    assert args.untie_embeddings_and_output_weights is (not tied)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == ITERATIONS
    assert common["megapipe_args"]["num_layers"] == repr(LAYERS)
