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

Differences met and how they are bridged:
- Megatron-Core writes one `_extra_state` byte entry per linear layer (TransformerEngine's FP8
  state; empty with the local spec). megapipe neither reads nor writes them, so Megatron-Core
  loads a megapipe checkpoint with those entries left out of its sharded state dict.
- Its `.metadata` also holds `all_local_plans` (DCP `SavePlan`s), allowed in safe_pickle.
- `common.pt` is merged into the state dict Megatron-Core's load returns: megapipe's entries
  there are unexpected keys for `GPTModel.load_state_dict` (hence strict=False).
- The vocabulary must need no padding: Megatron-Core's `GPTModel` stores as many rows as it is
  given (Megatron-LM gives it the padded size), megapipe stores the unpadded vocabulary.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's checkpoint writer needs it

from megapipe.arguments import parse_args  # noqa: E402
from megapipe.checkpointing.layout_free import model_shards  # noqa: E402
from megapipe.checkpointing.torch_dist import load_sharded, save_sharded  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from megapipe.training.build import build_model_chunks_for  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 64, 4, 128, 16
FLAGS = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
    "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
    "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data", "--train-iters", "1",
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
        vocab_size=VOCAB,
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
        return model(tokens, positions, causal)  # [b, s, vocab]


def _megapipe_model(tied: bool):
    flags = FLAGS if tied else [*FLAGS, "--untie-embeddings-and-output-weights"]
    (model,) = build_model_chunks_for(parse_args(flags, 1), ParallelState.single())
    return model.eval()


def _megapipe_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).transpose(0, 1)  # [s, b, vocab] -> [b, s, vocab]


def _interchange(rank: int, world_size: int, tied: bool, tmp: str) -> dict[str, float]:
    from megatron.core import dist_checkpointing, parallel_state

    _patch_cuda_calls()
    parallel_state.initialize_model_parallel(1, 1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out = {}

    # Megatron-Core -> megapipe
    mcore = _mcore_model(tied, seed=1)
    expected = _mcore_logits(mcore, tokens)
    from_mcore = os.path.join(tmp, "from_mcore")
    os.makedirs(from_mcore)
    dist_checkpointing.save(mcore.sharded_state_dict(), from_mcore)
    ours = _megapipe_model(tied)
    out["untrained"] = (_megapipe_logits(ours, tokens) - expected).abs().max().item()
    named = list(ours.named_parameters())
    load_sharded(
        from_mcore, model_shards(named, 0, 1, LAYERS, loading=True), group=None,
        require_checksums=False,
    )  # fmt: skip
    out["mcore_to_megapipe"] = (_megapipe_logits(ours, tokens) - expected).abs().max().item()

    # megapipe -> Megatron-Core (other weights than the ones it just read)
    with torch.no_grad():
        for _, param in named:
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    expected = _megapipe_logits(ours, tokens)
    from_megapipe = os.path.join(tmp, "from_megapipe")
    save_sharded(
        from_megapipe, model_shards(named, 0, 1, LAYERS), {"iteration": 7}, group=None,
        coordinator=True,
    )  # fmt: skip
    theirs = _mcore_model(tied, seed=2)
    out["untrained_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max().item()
    sharded = {
        k: v for k, v in theirs.sharded_state_dict().items() if not k.endswith("._extra_state")
    }
    state = dist_checkpointing.load(sharded, from_megapipe)
    result = theirs.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["iteration"], result
    out["megapipe_to_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max().item()
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_checkpoints_move_between_megatron_core_and_megapipe(tied: bool, tmp_path) -> None:
    (diffs,) = run_distributed(_interchange, 1, tied, str(tmp_path), timeout=240)
    print(diffs)
    # the comparisons see models that did not load
    assert diffs["untrained"] > 1e-2 and diffs["untrained_mcore"] > 1e-2, diffs
    assert diffs["mcore_to_megapipe"] < 1e-5, diffs
    assert diffs["megapipe_to_mcore"] < 1e-5, diffs
