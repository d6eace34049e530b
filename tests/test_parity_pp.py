"""Pipeline parity: the executor's losses, gradients and grad norm match one rank, over steps.

Each rank builds its model chunks and the single-rank reference from the same seed, trains
both with Adam for a few steps on the same global batches, and compares losses (last stage),
every gradient shard of the first step, and the grad norm of every step (later steps' losses
and norms check the optimizer updates too). The tolerance is the tensor-parallel one (2e-5
relative). Weights are not compared after Adam steps: Adam turns fp32 noise in near-zero
gradients into full-size updates, so they differ by up to ~lr while losses agree to 1e-6.
"""

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.distributed import finalize_model_grads, global_grad_norm
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.parity import shard_errors
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.simulator import simulate_kind
from megapipe.testing import run_distributed

torch.optim.Adam([torch.zeros(1)])  # first use imports torch._dynamo (~3 s): once, before forking

TOLERANCE = 2e-5
SEED = 99
MICRO_BATCH = 2


def config_for(num_layers: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=120,
        seq_length=8,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=not tied,
    )


def micro_batch(config, step, microbatch):
    g = torch.Generator().manual_seed(1000 * step + microbatch)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_length + 1), generator=g)
    mask = (torch.rand(MICRO_BATCH, config.seq_length, generator=g) > 0.25).float()
    from megapipe.data.batch import TrainingBatch

    return TrainingBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask)


def _pipeline_parity(
    rank,
    world,
    tp,
    pp,
    v,
    kind,
    tied,
    m,
    steps,
    sequence_parallel=False,
    every_stage=False,
    post_ahead=False,
    emulate=False,
):
    config = config_for(2 * pp * v, tied)
    state = ParallelState.build(tp, pp)
    stage_map = partition_layers(config, pp, v)
    chunks = build_model_chunks(
        config,
        state,
        RNGTracker(SEED, state.tp_rank, state.pp_rank),
        stage_map,
        seed=SEED,
        sequence_parallel=sequence_parallel,
    )
    executor = PipelineExecutor(
        chunks,
        state,
        build_schedule(kind, pp, v, m, state.pp_rank, post_ahead=post_ahead),
        num_microbatches=m,
        activation_shape=activation_shape(config, MICRO_BATCH, tp, sequence_parallel),
        batch_on_every_stage=every_stage,
        comm=P2PCommunicator(state, emulate_nccl_order=emulate),
    )
    reference = GPTModel(config, ParallelState.single(), RNGTracker(SEED), seed=SEED)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    out = {"loss": 0.0, "norm": 0.0, "grads": 0.0, "peak": 0, "freed": 0, "reads": []}
    for step in range(steps):

        def read(i, step=step):
            out["reads"].append((step, i))
            return micro_batch(config, step, i)

        losses = executor.run(read)
        finalize_model_grads(chunks, state)
        norm = global_grad_norm(params, state)
        ref_losses = []
        for i in range(m):
            b = micro_batch(config, step, i)
            loss = masked_mean(reference(tokens=b.tokens, labels=b.labels), b.loss_mask)
            (loss / m).backward()
            ref_losses.append(loss.detach())
        ref_norm = global_grad_norm(list(reference.parameters()), ParallelState.single())
        if losses:
            assert len(losses) == m
            err = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses))
            out["loss"] = max(out["loss"], err)
        out["norm"] = max(out["norm"], abs(norm - ref_norm) / ref_norm)
        if step == 0:
            out["grads"] = max(
                max(shard_errors(c, reference, state.tp_rank, tp, grads=True).values())
                for c in chunks
            )
            out["peak"], out["freed"] = executor.peak_stashed, executor.freed_outputs
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    shared = [c.shared_word_embedding() for c in chunks]
    shared = [s.detach().clone() for s in shared if s is not None]
    out["shared"] = shared
    out["has_loss"] = bool(losses)
    return out


LAYOUTS = [  # tp, pp, v, schedule, tied, micro-batches
    (1, 2, 1, "1f1b", True, 4),
    (1, 2, 1, "1f1b", False, 3),
    (1, 4, 1, "1f1b", True, 6),
    (1, 4, 1, "1f1b", False, 2),  # fewer micro-batches than stages
    (1, 2, 1, "gpipe", True, 3),
    (1, 2, 2, "interleaved-1f1b", True, 4),
    (1, 2, 2, "interleaved-1f1b", False, 2),
    (1, 4, 2, "interleaved-1f1b", True, 4),
    (2, 2, 1, "1f1b", True, 4),
    (2, 2, 2, "interleaved-1f1b", False, 4),
]


EMULATE = pytest.mark.parametrize("emulate", [False, True], ids=["gloo", "nccl-order"])


@EMULATE
@pytest.mark.parametrize("tp,pp,v,kind,tied,m", LAYOUTS)
def test_pipeline_matches_single_rank(tp, pp, v, kind, tied, m, emulate):
    check_pipeline_parity(tp, pp, v, kind, tied, m, emulate=emulate)


@pytest.mark.parametrize(
    "tp,pp,v,kind,tied,m",
    [
        (1, 2, 1, "1f1b", True, 4),
        (1, 4, 1, "1f1b", False, 2),  # fewer micro-batches than stages
        (1, 4, 2, "interleaved-1f1b", True, 4),
        (2, 2, 2, "interleaved-1f1b", False, 4),
    ],
)
@EMULATE
def test_receives_posted_ahead_match_single_rank(tp, pp, v, kind, tied, m, emulate):
    check_pipeline_parity(tp, pp, v, kind, tied, m, post_ahead=True, emulate=emulate)


def check_pipeline_parity(
    tp: int,
    pp: int,
    v: int,
    kind: str,
    tied: bool,
    m: int,
    post_ahead: bool = False,
    emulate: bool = False,
) -> None:
    """Three steps of `kind` at this layout match one rank; stashing as the simulator says.
    post_ahead: receives posted one unit early (--overlap-p2p-communication, the default).
    emulate: transfers in NCCL's order (--emulate-nccl-p2p-order)."""
    results = run_distributed(
        _pipeline_parity,
        tp * pp,
        tp,
        pp,
        v,
        kind,
        tied,
        m,
        3,
        post_ahead=post_ahead,
        emulate=emulate,
    )
    for r in results:
        assert r["loss"] < TOLERANCE and r["norm"] < TOLERANCE and r["grads"] < TOLERANCE, r
    assert sum(r["has_loss"] for r in results) == tp  # only the last stage computes the loss
    # Activation bound: each rank stashes exactly what the simulator predicts (1F1B: p - rank
    # on rank `rank`, at most p; zero-bubble: counted until W), and every output sent
    # downstream had its storage freed.
    sim = simulate_kind(kind, pp, v, m, post_ahead=post_ahead)
    for rank, r in enumerate(results):
        pp_rank = rank // tp
        # Only the first stage (tokens) and the last (labels, loss mask) read data, each
        # micro-batch once per step.
        reads_data = pp_rank in (0, pp - 1)
        assert sorted(r["reads"]) == sorted((s, i) for s in range(3) for i in range(m)) * int(
            reads_data
        )
        assert r["peak"] == sim.peak_in_flight[pp_rank]
        sends = m * v - (m if pp_rank == pp - 1 else 0)
        assert r["freed"] == sends
    if tied:  # the first stage's embedding and the last stage's copy stay bit-identical
        for t in range(tp):
            first, last = results[t]["shared"], results[t + tp * (pp - 1)]["shared"]
            assert len(first) == len(last) == 1
            assert torch.equal(first[0], last[0])


@EMULATE
def test_sequence_parallel_pipeline_matches_single_rank(emulate):
    results = run_distributed(
        _pipeline_parity, 4, 2, 2, 1, "1f1b", True, 4, 2, sequence_parallel=True, emulate=emulate
    )
    for r in results:
        assert r["loss"] < TOLERANCE and r["norm"] < TOLERANCE and r["grads"] < TOLERANCE, r


def _without_tied_embedding_sync(rank, world):
    from megapipe.distributed import finalize_grads

    finalize_grads.tied_embedding_grads = lambda chunks: []  # deliberately broken, this rank only
    return _pipeline_parity(rank, world, 1, 2, 1, "1f1b", True, 4, 2)


def test_skipping_the_tied_embedding_all_reduce_fails_parity():
    first, last = run_distributed(_without_tied_embedding_sync, 2)
    assert max(first["grads"], last["grads"]) > 1000 * TOLERANCE
    assert not torch.equal(first["shared"][0], last["shared"][0])


@EMULATE
def test_every_stage_reads_each_micro_batch_once_when_masks_need_it(emulate):
    """--reset-attention-mask: every chunk needs the batch; a rank still reads it once."""
    results = run_distributed(_pipeline_parity, 2, 1, 2, 2, "interleaved-1f1b", True, 4, 1,
                              every_stage=True, emulate=emulate)  # fmt: skip
    for r in results:
        assert r["loss"] < TOLERANCE and r["grads"] < TOLERANCE, r
        assert sorted(r["reads"]) == [(0, i) for i in range(4)]
