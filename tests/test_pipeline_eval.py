"""Forward-only pipeline steps (evaluation): the same losses as one rank, and no gradients.

Each rank builds its chunks, gradient buffers and training executor with the product's own
helpers (training/build.py), then an evaluation executor for another number of micro-batches
(`for_schedule("forward-only", m)`), and runs it with the chunks in eval mode (dropout 0.1 in
the config, so train mode would change the losses). The reference is the single-rank model in
eval mode with the loss written out in plain PyTorch (cross-entropy over the real vocabulary,
masked mean). After the forward-only step no parameter has a `.grad` and every gradient buffer
is zero; a training step on the same communicator still works afterwards.
"""

import pytest
import torch
import torch.nn.functional as F

from megapipe.arguments import parse_args
from megapipe.data.batch import TrainingBatch
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.simulator import simulate_kind
from megapipe.testing import run_distributed
from megapipe.training.build import build_executor, build_model_chunks_for, build_optimizer

torch.optim.Adam([torch.zeros(1)])  # first use imports torch._dynamo (~3 s): once, before forking

SEED = 1234
MICRO_BATCH = 2
SEQ = 8
VOCAB = 100  # padded to 128 by TP: padding logits must stay out of the loss
TRAIN_M = 4  # global batch 8 / micro-batch 2
LAYERS = 4
EVAL_M = 3  # not a multiple of PP=2, which the interleaved training schedule refuses


def _flags(tp: int, pp: int, v: int) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--mock-data",
        "--vocab-size", str(VOCAB), "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(MICRO_BATCH * TRAIN_M), "--train-iters", "1", "--lr", "1e-3",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--seed", str(SEED),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
    ] + (["--num-layers-per-virtual-pipeline-stage", str(LAYERS // (pp * v))] if v > 1
         else [])  # fmt: skip


def _batch(microbatch: int) -> TrainingBatch:
    g = torch.Generator().manual_seed(500 + microbatch)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.25).float()
    return TrainingBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask)


def _reference_losses(configs, microbatches: int) -> list[float]:
    """The single-rank model in eval mode; loss in plain PyTorch from its logits."""
    model = GPTModel(configs.model, ParallelState.single(), RNGTracker(SEED), seed=SEED).eval()
    losses = []
    with torch.no_grad():
        for i in range(microbatches):
            b = _batch(i)
            logits = model(tokens=b.tokens)[..., :VOCAB].transpose(0, 1)  # [b, s, vocab]
            per_token = F.cross_entropy(
                logits.reshape(-1, VOCAB), b.labels.reshape(-1), reduction="none"
            )
            losses.append(float((per_token * b.loss_mask.reshape(-1)).sum() / b.loss_mask.sum()))
    return losses


class _Recording(torch.nn.Module):
    """A chunk that records the `sample_ids` its forward gets ("absent" when not passed) and
    whether autograd was recording."""

    def __init__(self, model: GPTModel, seen: list, grad_enabled: list) -> None:
        super().__init__()
        self.model, self.seen, self.grad_enabled = model, seen, grad_enabled

    def forward(self, **kwargs):
        self.seen.append(kwargs.pop("sample_ids", "absent"))
        self.grad_enabled.append(torch.is_grad_enabled())
        return self.model(**kwargs)


def _evaluate(rank: int, world: int, tp: int, pp: int, v: int, emulate: bool) -> dict:
    configs = parse_args(_flags(tp, pp, v) + ["--emulate-nccl-p2p-order"] * emulate, world)
    state = ParallelState.build(tp, pp)
    chunks = build_model_chunks_for(configs, state)
    optimizer = build_optimizer(chunks, configs, state)
    training = build_executor(chunks, configs, state)
    evaluation = training.for_schedule("forward-only", EVAL_M)
    reads, seen, grad_enabled = [], [], []
    evaluation.chunks = [_Recording(chunk, seen, grad_enabled) for chunk in chunks]

    def read(i: int) -> TrainingBatch:
        reads.append(i)
        return _batch(i)

    def sample_ids(i: int) -> torch.Tensor:
        return torch.arange(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)

    for chunk in chunks:
        chunk.eval()
    losses = evaluation.run(read, sample_ids=sample_ids)
    out = {
        "losses": [float(x) for x in losses],
        "grad_enabled": grad_enabled,
        "grads": [n for c in chunks for n, p in c.named_parameters() if p.grad is not None],
        "buffers_zero": all(bool((b.grad_data == 0).all()) for b in optimizer.buffers),
        "peak": evaluation.peak_stashed,
        "freed": evaluation.freed_outputs,
        "reads": sorted(reads),
        "ids": sorted(x.tolist() for x in seen),
        "is_last": state.is_last_stage,
    }
    for chunk in chunks:
        chunk.train()
    train_losses = training.run(_batch)  # the training executor still works on the same comm
    out["train_losses"] = len(train_losses)
    out["trained_grads"] = any(bool((b.grad_data != 0).any()) for b in optimizer.buffers)
    return out


@pytest.mark.parametrize(
    "tp,pp,v", [(1, 2, 1), (1, 2, 2), (2, 2, 1)], ids=["pp2", "pp2-v2", "tp2xpp2"]
)
@pytest.mark.parametrize("emulate", [False, True], ids=["gloo", "nccl-order"])
def test_forward_only_matches_one_rank_and_touches_no_gradient(tp, pp, v, emulate):
    results = run_distributed(_evaluate, tp * pp, tp, pp, v, emulate)
    reference = _reference_losses(parse_args(_flags(1, 1, 1), 1), EVAL_M)
    sim = simulate_kind("forward-only", pp, v, EVAL_M)
    for rank, r in enumerate(results):
        pp_rank = rank // tp
        if r["is_last"]:
            assert len(r["losses"]) == EVAL_M  # per micro-batch, not averaged or scaled
            for got, want in zip(r["losses"], reference):
                assert got == pytest.approx(want, rel=2e-5)
            assert r["train_losses"] == TRAIN_M
        else:
            assert r["losses"] == [] and r["train_losses"] == 0
        assert r["grad_enabled"] == [False] * (EVAL_M * v)  # no graph is built
        assert r["grads"] == [] and r["buffers_zero"], r["grads"]
        assert r["trained_grads"]  # the buffers do see the training step's gradients
        # One output at a time (sent, then let go of), none on the last stage with one chunk;
        # nothing needed freeing since no graph was kept.
        assert r["peak"] == sim.peak_in_flight[pp_rank] <= 1 and r["freed"] == 0
        assert r["reads"] == (list(range(EVAL_M)) if pp_rank in (0, pp - 1) else [])
        # every chunk's forward is given its micro-batch's sample ids
        assert r["ids"] == sorted([[2 * i, 2 * i + 1] for i in range(EVAL_M)] * v)


def test_forward_only_at_one_stage_without_sample_ids_never_passes_the_keyword():
    configs = parse_args(_flags(1, 1, 1), 1)
    model = GPTModel(configs.model, ParallelState.single(), RNGTracker(SEED), seed=SEED).eval()
    state = ParallelState.single()
    base = PipelineExecutor([model], state, [], num_microbatches=1, activation_shape=(SEQ, 2, 32))
    executor = base.for_schedule("forward-only", EVAL_M)
    seen, grad_enabled = [], []
    executor.chunks = [_Recording(model, seen, grad_enabled)]
    losses = executor.run(_batch)
    assert seen == ["absent"] * EVAL_M  # never sample_ids=None: older forwards lack the keyword
    assert grad_enabled == [False] * EVAL_M
    reference = _reference_losses(configs, EVAL_M)
    assert [float(x) for x in losses] == pytest.approx(reference, rel=1e-6)
    assert executor.peak_stashed == 0 and all(p.grad is None for p in model.parameters())
