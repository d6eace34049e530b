"""Generation from an MoE checkpoint (megapipe/inference; the KV cache is unchanged, each
decoding step routes its one new token): a small MoE model trained on counting sequences,
loaded by the generation tools' loader at 1 rank and TP2, generates greedily exactly what
transformers' `MixtralForCausalLM.generate(do_sample=False)` generates from its export (an
independent reference), and the same with the KV cache as by recomputing the whole prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megapipe.inference.generation import generate
from megapipe.inference.loading import load_inference_model
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from tests.helpers import MOCK, NO_DROPOUT, run
from tests.helpers import convert_gpt as tool

transformers = pytest.importorskip("transformers")

MOE_COUNTING = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "10", "--eval-iters", "0",
    "--train-iters", "30", "--position-embedding-type", "rope", "--rotary-base", "1000",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
]  # fmt: skip
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [90, 91, 92, 93]]
NEW = 10


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/ckpt: an MoE checkpoint; root/hf: its Mixtral export."""
    root = tmp_path_factory.mktemp("moe_gen")
    run(1, MOE_COUNTING + MOCK + NO_DROPOUT + ["--save", str(root / "ckpt")])
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"),
                "--save-dir", str(root / "hf")) == 0  # fmt: skip
    return root


def _generate_on_ranks(rank: int, world: int, load: str, tp: int, kwargs: dict):
    torch.set_num_threads(1)
    return generate(load_inference_model(load, ParallelState.build(tp, 1)), **kwargs)


def generated(load: Path, tp: int = 1, **kwargs) -> list[list[int]]:
    kwargs = {"prompts": PROMPTS, "max_new_tokens": NEW, **kwargs}
    if tp == 1:
        results = generate(load_inference_model(str(load), ParallelState.single()), **kwargs)
    else:
        per_rank = run_distributed(_generate_on_ranks, tp, str(load), tp, kwargs)
        results = per_rank[0]
        assert all(r == results for r in per_rank), "ranks disagree"
    return [r.tokens for r in results]


def mixtral_greedy(directory: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    assert type(model).__name__ == "MixtralForCausalLM"
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.eval().generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_moe_greedy_generation_equals_mixtral_generate(trained: Path) -> None:
    theirs = mixtral_greedy(trained / "hf")
    assert theirs[0][:3] == [8, 9, 10], theirs  # it learned to count: the margins are clear
    for tp in (1, 2):
        ours = generated(trained / "ckpt", tp)
        print(f"\nTP{tp}: {ours}")
        assert ours == theirs, (tp, ours, theirs)
    assert generated(trained / "ckpt", use_cache=False) == theirs  # full recomputation
