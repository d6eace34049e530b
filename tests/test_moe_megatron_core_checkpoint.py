"""MoE checkpoints interchange with Megatron-Core 0.16.1: the checkpoint of a megapipe MoE
training run (`--save`) loads into Megatron-Core's MoE `GPTModel` (local spec, SequentialMLP)
through its whole `sharded_state_dict()` and `dist_checkpointing.load`, and one Megatron-Core
writes loads into megapipe, also as Megatron-LM's save_checkpoint writes it (its `args` in
common.pt giving the model: megapipe's reader of Megatron-LM checkpoints); either way the
logits agree. A Megatron-LM MoE model with add_bias_linear (a router bias) is refused. With
MoE on every layer (stacked keys, `decoder.layers.mlp.experts.experts.linear_fc1.weight`
[L, E, fc1, h]) and on layer 0 only (Megatron-Core's non-homogeneous layers:
`decoder.layers.<i>.*` keys, no layer axis).

Megatron-Core runs on CPU as in test_megatron_core_interchange (its CUDA calls patched in the
forked rank) and, without TransformerEngine, with its router's missing `te_general_gemm` name
set to None (as test_moe_megatron_core). Biases are off: megapipe's router has no bias, while
Megatron-Core's has one with add_bias_linear."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

from megapipe.arguments import parse_args  # noqa: E402
from megapipe.checkpointing.errors import CheckpointError  # noqa: E402
from megapipe.checkpointing.layout_free import (  # noqa: E402
    checkpointed_tensors,
    fit_vocabulary,
    model_shards,
    stacks_layers,
)
from megapipe.checkpointing.torch_dist import load_sharded  # noqa: E402
from megapipe.checkpointing.tracker import iteration_dir  # noqa: E402
from megapipe.conversion.convert import Source, _fill, build_rank  # noqa: E402
from megapipe.conversion.megatron_lm_source import read_any  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.testing import run_distributed  # noqa: E402
from megapipe.training.build import build_model_chunks_for  # noqa: E402
from tests.helpers import run  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, PADDED, SEQ, E, FFN = 2, 32, 4, 100, 128, 16, 4, 64
ITERATIONS = 2
FLAGS = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
    "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
    "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
    "--train-iters", str(ITERATIONS), "--eval-iters", "0", "--lr", "1e-2",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--swiglu", "--disable-bias-linear",
    "--num-experts", str(E), "--moe-router-topk", "2", "--ffn-hidden-size", str(FFN),
]  # fmt: skip


def _flags(freq: str) -> list[str]:
    return [*FLAGS, "--moe-layer-freq", freq]


def _mcore_model(freq: str, seed: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, num_moe_experts=E, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", moe_layer_freq=1 if freq == "1" else [1, 0],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=PADDED,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    with torch.no_grad():  # a router far from uniform, so that routing matters
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def _mcore_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(tokens, positions, causal)[..., :VOCAB]


def _megapipe(freq: str, directory: str | None, require_checksums: bool = True):
    configs = parse_args(_flags(freq), 1)
    (model,) = build_model_chunks_for(configs, ParallelState.single())
    if directory is not None:
        stacked = stacks_layers(configs.model)
        assert stacked == (freq == "1")
        wanted = model_shards(checkpointed_tensors(model), 0, 1, LAYERS, loading=True,
                              stacked=stacked)  # fmt: skip
        load_sharded(directory, wanted, group=None, require_checksums=require_checksums,
                     fit=fit_vocabulary)  # fmt: skip
    return model.eval()


def _megatron_lm_checkpoint(mcore, freq: str, save: str, **overrides) -> Source:
    """`mcore` saved as Megatron-LM's save_checkpoint saves torch_dist, read back by megapipe."""
    from megatron.core import dist_checkpointing

    from tests.megatron_lm_checkpoints import model_args, scheduler_state, write_tracker

    args = model_args("llama", 1, 1)
    moe = {
        "num_experts": E,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": FFN,
        "moe_layer_freq": 1 if freq == "1" else [1, 0],
        "moe_aux_loss_coeff": 0.0,
        "moe_router_score_function": "softmax",
        "moe_token_dispatcher_type": "alltoall",
    }
    vars(args).update(
        ffn_hidden_size=FFN, group_query_attention=False, num_query_groups=1,
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        untie_embeddings_and_output_weights=False, seq_length=SEQ, max_position_embeddings=SEQ,
        vocab_size=VOCAB - 1, padded_vocab_size=PADDED, **moe, **overrides,
    )  # fmt: skip
    directory = os.path.join(save, "iter_0000005")
    os.makedirs(directory)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 5,
        "model": mcore.sharded_state_dict(),
        "opt_param_scheduler": scheduler_state(args),
    }
    dist_checkpointing.save(state, directory)  # fmt: skip
    write_tracker(save, "5")
    return read_any(directory, say=lambda _: None)


def _megapipe_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :VOCAB]


def _interchange_all(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> dict:
    """Every case in one forked rank (Megatron-Core imports once): freq -> differences."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from tests.megatron_lm_checkpoints import patch_cuda_calls

    patch_cuda_calls()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    return {freq: _interchange(freq, *paths) for freq, paths in cases.items()}


def _interchange(freq: str, tmp: str, trained: str) -> dict[str, float]:
    from megatron.core import dist_checkpointing

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out: dict[str, float] = {}

    # Megatron-Core -> megapipe
    mcore = _mcore_model(freq, seed=1)
    expected = _mcore_logits(mcore, tokens)
    from_mcore = os.path.join(tmp, "from_mcore")
    os.makedirs(from_mcore)
    dist_checkpointing.save(mcore.sharded_state_dict(), from_mcore)
    out["untrained"] = (_megapipe_logits(_megapipe(freq, None), tokens) - expected).abs().max()
    ours = _megapipe(freq, from_mcore, require_checksums=False)
    out["mcore_to_megapipe"] = (_megapipe_logits(ours, tokens) - expected).abs().max()
    # the same model as Megatron-LM's save_checkpoint writes it (its args in common.pt), read by
    # megapipe's reader of Megatron-LM checkpoints: the model comes from the args alone
    source = _megatron_lm_checkpoint(mcore, freq, os.path.join(tmp, "megatron_lm"))
    (model,) = build_rank(source.config, 0, 1, 0, [range(LAYERS)], 1)
    _fill([model], source, 0, 1)
    out["megatron_lm_to_megapipe"] = (_megapipe_logits(model.eval(), tokens) - expected).abs().max()
    try:
        _megatron_lm_checkpoint(mcore, freq, os.path.join(tmp, "biased"), add_bias_linear=True)
        out["router bias refused"] = 0.0
    except CheckpointError as error:
        out["router bias refused"] = float("router, which megapipe's router lacks" in str(error))

    # megapipe -> Megatron-Core: a megapipe MoE training run's checkpoint, as it is
    expected = _megapipe_logits(_megapipe(freq, trained), tokens)
    theirs = _mcore_model(freq, seed=2)
    out["untrained_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max()
    sharded = theirs.sharded_state_dict()  # the whole of it: every _extra_state entry too
    state = dist_checkpointing.load(sharded, trained)
    theirs.load_state_dict({k: state[k] for k in sharded}, strict=True)
    out["megapipe_to_mcore"] = (_mcore_logits(theirs, tokens) - expected).abs().max()
    out["logit scale"] = expected.abs().max()
    return {k: float(v) for k, v in out.items()}


FREQS = {"all-moe": "1", "moe-on-layer-0": "[1,0]"}


@pytest.fixture(scope="module")
def differences(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    cases = {}
    for name, freq in FREQS.items():
        root = tmp_path_factory.mktemp(name)
        run(1, [*_flags(freq), "--save", str(root / "megapipe")])
        cases[freq] = (str(root), iteration_dir(str(root / "megapipe"), ITERATIONS))
    return run_distributed(_interchange_all, 1, cases, timeout=300)[0]


@pytest.mark.parametrize("freq", list(FREQS.values()), ids=list(FREQS))
def test_moe_checkpoints_move_between_megatron_core_and_megapipe(differences, freq: str) -> None:
    diffs = differences[freq]
    print(f"\n{freq}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert diffs["untrained"] > 1e-2 and diffs["untrained_mcore"] > 1e-2, diffs
    assert diffs["mcore_to_megapipe"] < 1e-5, diffs
    assert diffs["megapipe_to_mcore"] < 1e-5, diffs
    assert diffs["megatron_lm_to_megapipe"] < 1e-5, diffs
    assert diffs["router bias refused"] == 1.0, diffs
