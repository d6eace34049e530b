"""Tensor-parallel parity: logits, loss, every gradient and the grad norm match one rank.

Each rank builds the single-rank reference model and its own TP shard of the same model from
the same seed, runs one forward/backward on the same batch, and measures the relative error
(max |a - b| / max |b|) of its shard against the matching slice of the reference.

Tolerance: 2e-5 relative. The measured errors are at most 6.3e-7 (fp32 rounding from summing
partial products in a different order); a missing all-reduce or a wrong shard gives errors
of 4e-2 to 1 (the deliberately broken runs below), so the bound separates the two widely.
"""

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.distributed import finalize_model_grads, global_grad_norm
from megapipe.layers import linear_function
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model import GPTModel
from megapipe.parallel import mappings
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from megapipe.testing.parity import relative_error, shard_errors

TOLERANCE = 2e-5
SEED = 1234

MODELS = {
    "rope-rmsnorm-swiglu-gqa": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=4,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    ),
    "learned-layernorm-gelu": dict(
        position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False
    ),
}


def model_config(variant: str) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        vocab_size=500,
        seq_length=16,
        ffn_hidden_size=96,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **MODELS[variant],
    )


def batch(config: ModelConfig, micro_batch: int = 3):
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length + 1), generator=g)
    loss_mask = (torch.rand(micro_batch, config.seq_length, generator=g) > 0.2).float()
    return tokens[:, :-1], tokens[:, 1:], loss_mask


def one_step(model: GPTModel, state: ParallelState, config: ModelConfig):
    tokens, labels, loss_mask = batch(config)
    with torch.no_grad():
        logits = model(tokens=tokens)
    loss = masked_mean(model(tokens=tokens, labels=labels), loss_mask)
    loss.backward()
    finalize_model_grads([model], state)
    return logits, loss.detach(), global_grad_norm(model.parameters(), state)


def _tp_parity(rank, world, variant, sequence_parallel):
    config = model_config(variant)
    state = ParallelState.build(tensor_model_parallel_size=world)
    reference = GPTModel(config, ParallelState.single(), RNGTracker(SEED), seed=SEED)
    model = GPTModel(
        config,
        state,
        RNGTracker(SEED, tp_rank=state.tp_rank),
        seed=SEED,
        sequence_parallel=sequence_parallel,
    )
    weight_errors = shard_errors(model, reference, state.tp_rank, world, grads=False)

    ref_logits, ref_loss, ref_norm = one_step(reference, ParallelState.single(), config)
    logits, loss, norm = one_step(model, state, config)
    start = model.vocab_start
    return {
        "weights": max(weight_errors.values()),
        "logits": relative_error(logits, ref_logits[..., start : start + logits.shape[-1]]),
        "loss": relative_error(loss, ref_loss),
        "grad_norm": abs(norm - ref_norm) / ref_norm,
        "grads": shard_errors(model, reference, state.tp_rank, world, grads=True),
    }


def worst(results):
    """The largest error of each kind over ranks, and the worst gradient with its name."""
    out = {k: max(r[k] for r in results) for k in ("weights", "logits", "loss", "grad_norm")}
    out["grads"], out["worst_grad"] = max(
        (err, name) for r in results for name, err in r["grads"].items()
    )
    return out


LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


@pytest.mark.parametrize("variant", sorted(MODELS))
@pytest.mark.parametrize("tp,sequence_parallel", LAYOUTS)
def test_tensor_parallel_matches_single_rank(variant, tp, sequence_parallel):
    errors = worst(run_distributed(_tp_parity, tp, variant, sequence_parallel))
    assert errors["weights"] == 0.0  # layout-invariant initialisation is exact
    for kind in ("logits", "loss", "grad_norm", "grads"):
        assert errors[kind] < TOLERANCE, (kind, errors)


def _broken(rank, world, variant, sequence_parallel, which):
    """The same parity run with one collective deliberately broken (patched in this rank only)."""
    if which == "no-backward-all-reduce":  # Megatron's f without its all-reduce
        linear_function.start_all_reduce = lambda x, group: mappings.Pending(x)
    elif which == "no-backward-reduce-scatter":  # SP: split the input gradient without a sum
        linear_function.start_reduce_scatter_sequence = lambda x, group: mappings.Pending(
            mappings.split_along(x, 0, group)
        )
    elif which == "backward-gather-repeats-the-shard":  # SP: dW from a wrong sequence
        linear_function.start_all_gather_sequence = lambda x, group: mappings.Pending(
            torch.cat([x] * group.size)
        )
    elif which == "no-reduce-scatter-sum":  # SP: split the sequence without summing partials
        mappings._ReduceScatterSequence.forward = staticmethod(
            lambda ctx, x, group: (setattr(ctx, "group", group), mappings.split_along(x, 0, group))[
                1
            ]
        )
    return _tp_parity(rank, world, variant, sequence_parallel)


@pytest.mark.parametrize(
    "which,sequence_parallel,kind",
    [
        ("no-backward-all-reduce", False, "grads"),
        ("no-reduce-scatter-sum", True, "logits"),
        ("no-backward-reduce-scatter", True, "grads"),
        ("backward-gather-repeats-the-shard", True, "grads"),
    ],
)
def test_a_broken_mapping_fails_parity(which, sequence_parallel, kind):
    errors = worst(run_distributed(_broken, 2, "learned-layernorm-gelu", sequence_parallel, which))
    assert errors[kind] > 1000 * TOLERANCE, errors
