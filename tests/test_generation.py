"""Text generation with a KV cache (megapipe/inference, tools/generate_text.py).

A tiny model is trained on mock data (sequences that count up, so it learns "next = last + 1"
and its greedy choices have clear margins), exported to transformers, and:
- greedy generation equals transformers' `generate(do_sample=False)` token for token, at 1
  rank, TP=2 and PP=2 (GPT-2 and Llama shapes: learned and rotary positions, GQA);
- with and without the KV cache give the same tokens (greedy and sampled), and a batch of
  prompts of different lengths gives what each prompt gets alone;
- an imported random transformers model gives its own logits in megapipe at TP=2 and PP=2;
- sampling filters match a hand computation; the tool reads prompts, writes JSON, stops at
  EOD and refuses bad input with one line.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megapipe.inference.generation import full_logits, generate
from megapipe.inference.loading import load_inference_model
from megapipe.inference.sampling import SamplingOptions, filtered_logits, sample
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed
from tests.helpers import MOCK, NO_DROPOUT, random_hf_model, run

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _load_tool(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_tool = _load_tool("convert_tool", "tools/checkpoint/convert.py")
generate_tool = _load_tool("generate_tool", "tools/generate_text.py")

COUNTING = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "10", "--eval-iters", "0",
    "--train-iters", "30",
]  # fmt: skip
LLAMA = [
    "--position-embedding-type", "rope", "--rotary-base", "1000", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2",
]  # fmt: skip
SHAPES = {"gpt2": [], "llama": LLAMA}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [90, 91, 92, 93]]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def trained(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(kind, root): root/ckpt a megapipe checkpoint, root/hf its transformers export."""
    root = tmp_path_factory.mktemp(f"gen_{request.param}")
    run(1, COUNTING + MOCK + NO_DROPOUT + SHAPES[request.param] + ["--save", str(root / "ckpt")])
    argv = ["--model-type", "GPT", "--saver", "hf", "--load-dir", str(root / "ckpt")]
    assert convert_tool.main([*argv, "--save-dir", str(root / "hf")]) == 0
    return request.param, root


def _generate_on_ranks(rank: int, world: int, load: str, tp: int, pp: int, kwargs: dict):
    state = ParallelState.build(tp, pp)
    model = load_inference_model(load, state)
    return generate(model, **kwargs)


def generated(load: Path, tp: int = 1, pp: int = 1, **kwargs) -> list[list[int]]:
    kwargs = {"prompts": PROMPTS, "max_new_tokens": 12, **kwargs}
    if tp * pp == 1:
        results = generate(load_inference_model(str(load), ParallelState.single()), **kwargs)
    else:
        per_rank = run_distributed(_generate_on_ranks, tp * pp, str(load), tp, pp, kwargs)
        results = per_rank[0]
        assert all(r == results for r in per_rank), "ranks disagree"
    return [r.tokens for r in results]


def hf_greedy(directory: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        out.append(tokens[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["1rank", "tp2", "pp2"])
def test_greedy_equals_transformers_generate(trained, layout) -> None:
    kind, root = trained
    ours = generated(root / "ckpt", *layout)
    theirs = hf_greedy(root / "hf", PROMPTS, 12)
    print(f"\n{kind} {layout}: {ours}")
    assert ours == theirs
    assert ours[0][:3] == [8, 9, 10]  # it did learn to count: the comparison means something


def test_kv_cache_changes_nothing_but_speed(trained) -> None:
    kind, root = trained
    for options in (SamplingOptions(greedy=True), SamplingOptions(temperature=1.5, top_k=20)):
        cached = generated(root / "ckpt", options=options, seed=3)
        recomputed = generated(root / "ckpt", options=options, seed=3, use_cache=False)
        assert cached == recomputed, (kind, options)


def test_a_batch_gives_what_each_prompt_gets_alone(trained) -> None:
    _, root = trained
    together = generated(root / "ckpt", tp=2)
    alone = [generated(root / "ckpt", prompts=[p])[0] for p in PROMPTS]
    assert together == alone


def test_sampling_is_seeded_and_stops_at_eod(trained) -> None:
    _, root = trained
    hot = SamplingOptions(temperature=3.0)
    first, again = (generated(root / "ckpt", options=hot, seed=11) for _ in range(2))
    other = generated(root / "ckpt", options=hot, seed=12)
    assert first == again and first != other
    greedy = generated(root / "ckpt")
    stop_at = greedy[1][2]  # the third token greedy writes for prompt 1
    model = load_inference_model(str(root / "ckpt"), ParallelState.single())
    results = generate(model, PROMPTS, 12, eod=stop_at)
    assert results[1].stopped_at_eod
    assert results[1].tokens == greedy[1][: greedy[1].index(stop_at) + 1]
    assert stop_at not in greedy[0]
    assert not results[0].stopped_at_eod and results[0].tokens == greedy[0]


def _logits_on_ranks(rank: int, world: int, load: str, tp: int, pp: int, tokens):
    return full_logits(load_inference_model(load, ParallelState.build(tp, pp)), tokens)


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_imported_model_gives_its_logits_at_tp2_and_pp2(kind: str, tmp_path: Path) -> None:
    random_hf_model(kind, tmp_path / "hf")
    argv = ["--model-type", "GPT", "--loader", "hf", "--load-dir", str(tmp_path / "hf")]
    assert convert_tool.main([*argv, "--save-dir", str(tmp_path / "mp")]) == 0
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [2, 7, 1, 8] * 3])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    for tp, pp in ((2, 1), (1, 2)):
        per_rank = run_distributed(_logits_on_ranks, tp * pp, str(tmp_path / "mp"), tp, pp, tokens)
        diff = max((ours - theirs).abs().max().item() for ours in per_rank)
        print(f"\n{kind} TP{tp} PP{pp}: import max |logit diff| = {diff:.3g}")
        assert diff < 1e-4


def test_sampling_filters_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    inf = float("-inf")
    top2 = filtered_logits(logits, SamplingOptions(top_k=2))
    assert top2.tolist() == [[2.0, inf, inf, inf, 3.0]]
    probs = torch.softmax(logits[0], 0)  # sorted: ids 4, 0, 1, 2, 3 with mass .64 .24 .09 ...
    assert 0.6 < probs[4] < 0.7 and 0.85 < probs[4] + probs[0] < 0.9
    nucleus = filtered_logits(logits, SamplingOptions(top_p=0.7))  # .64 < .7: two tokens
    assert nucleus.tolist() == [[2.0, inf, inf, inf, 3.0]]
    only_best = filtered_logits(logits, SamplingOptions(top_p=0.5))
    assert only_best.tolist() == [[inf, inf, inf, inf, 3.0]]
    halved = filtered_logits(logits, SamplingOptions(temperature=2.0))
    assert torch.equal(halved, logits / 2)
    generator = torch.Generator().manual_seed(0)
    draws = [sample(logits, SamplingOptions(top_k=2), generator).item() for _ in range(200)]
    assert set(draws) == {0, 4} and 0.6 < draws.count(4) / 200 < 0.85  # p(4) = e/(e+1) = .73
    assert SamplingOptions(top_k=2, top_p=0.5).problems()
    assert SamplingOptions(temperature=0).problems()


def tool(capsys, *argv: str) -> tuple[int, str, str]:
    status = generate_tool.main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_tool_writes_prompts_continuations_and_json(trained, tmp_path, capsys) -> None:
    _, root = trained
    (tmp_path / "prompts.txt").write_text("40 41 42\n\n70 71 72 73\n")
    status, out, err = tool(
        capsys, "--load", str(root / "ckpt"), "--prompt", "5 6 7", "--prompts-file",
        str(tmp_path / "prompts.txt"), "--max-new-tokens", "4", "--greedy",
        "--output-file", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert status == 0, err
    assert "5 6 7 8 9 10 11" in out
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["5 6 7", "40 41 42", "70 71 72 73"]
    assert records[0]["tokens"] == [8, 9, 10, 11] and records[0]["text"] == "8 9 10 11"
    assert "tokens/s" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--prompt", " ".join(["1"] * 60), "--max-new-tokens", "10"],
            "exceed the model's context",
        ),
        (["--prompt", "5 6 100"], "token id 100 is outside the model's vocabulary"),
        (["--prompt", "5 six"], "NullTokenizer expects integers"),
        (["--prompt", "5", "--top-k", "3", "--top-p", "0.5"], "--top-k and --top-p"),
        (["--prompt", "5", "--temperature", "0"], "--temperature 0.0: must be > 0"),
        (["--prompt", "5", "--tensor-model-parallel-size", "2"], "must equal the number of ranks"),
        ([], "no prompt"),
    ],
)
def test_bad_input_gets_one_line_and_status_2(trained, capsys, argv, message) -> None:
    _, root = trained
    status, out, err = tool(capsys, "--load", str(root / "ckpt"), *argv)
    errors = [line for line in err.splitlines() if "error" in line or "Traceback" in line]
    assert status == 2 and len(errors) == 1 and message in errors[0], err
    assert errors[0].startswith("generate_text.py: error:")


def test_a_missing_checkpoint_is_named(tmp_path, capsys) -> None:
    status, _, err = tool(capsys, "--load", str(tmp_path / "nothing"), "--prompt", "1")
    assert status == 2 and "nothing" in err and len(err.strip().splitlines()) == 1
