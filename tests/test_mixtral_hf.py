"""Hugging Face Mixtral (`MixtralForCausalLM`) through `tools/checkpoint/convert.py`: a random
transformers Mixtral (fp32, save_pretrained's classic on-disk layout) imported into megapipe
gives transformers' own logits; import -> export gives back the very same tensors; a megapipe
MoE model trained at TP2 and exported loads with `from_pretrained` and gives megapipe's logits;
what Mixtral cannot hold is refused in one line naming the flag."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.hf_safetensors import read_weights
from megapipe.conversion.convert import Source, _fill, build_rank, read_source, resolve
from megapipe.conversion.hf_export import architecture
from megapipe.errors import ConfigError
from tests.helpers import convert_gpt as tool
from tests.helpers import run

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
TOKENS = torch.tensor([[5, 17, 99, 0, 42, 8, 3, 64, 11, 27, 90, 1, 2, 33, 71, 50]] * 2)
TOKENS[1] = TOKENS[1].flip(0)
MIXTRAL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "100",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--lr", "1e-2",
    "--train-iters", "2", "--eval-iters", "0", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--num-experts", "4",
    "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--init-method-std", "0.1",
]  # fmt: skip


def random_mixtral(directory: Path) -> None:
    """A small random Mixtral, its router far from uniform and its norms off their init."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif "gate" in name and "proj" not in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(directory))


def weights(load_dir: Path) -> Source:
    return read_source(resolve(str(load_dir))[0], say=lambda _: None)


def megapipe_logits(source: Source) -> torch.Tensor:
    config = source.config
    (model,) = build_rank(config, 0, 1, 0, [range(config.num_layers)], 1)
    _fill([model], source, 0, 1)
    model.eval()
    with torch.no_grad():
        return model(tokens=TOKENS).transpose(0, 1)[..., : config.vocab_size].float()


def hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    assert type(model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        return model.eval()(TOKENS).logits.float()


def test_an_imported_mixtral_gives_its_logits_and_round_trips(tmp_path: Path) -> None:
    random_mixtral(tmp_path / "hf")
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"),
                "--save-dir", str(tmp_path / "mp")) == 0  # fmt: skip
    imported = weights(tmp_path / "mp")
    moe = imported.config.moe
    assert moe is not None and (moe.num_experts, moe.moe_router_topk) == (4, 2)
    ours, theirs = megapipe_logits(imported), hf_logits(tmp_path / "hf")
    diff = (ours - theirs).abs().max().item()
    print(
        f"\nMixtral import: max |logit diff| = {diff:.2g} (logits up to {theirs.abs().max():.2g})"
    )
    assert diff < TOLERANCE and theirs.abs().max() > 0.1
    # import (at TP2 too) -> export: the same tensors, bit for bit
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir",
                str(tmp_path / "mp2"), "--target-tensor-parallel-size", "2") == 0  # fmt: skip
    original = read_weights(str(tmp_path / "hf"))
    for source in ("mp", "mp2"):
        back = tmp_path / f"back_{source}"
        assert tool("--saver", "hf", "--load-dir", str(tmp_path / source),
                    "--save-dir", str(back)) == 0  # fmt: skip
        exported = read_weights(str(back))
        assert sorted(exported) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (source, name)


def test_a_megapipe_moe_model_exports_to_mixtral(tmp_path: Path) -> None:
    run(2, [*MIXTRAL_FLAGS, "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck")])
    assert tool("--saver", "hf", "--load-dir", str(tmp_path / "ck"),
                "--save-dir", str(tmp_path / "hf")) == 0  # fmt: skip
    ours, theirs = megapipe_logits(weights(tmp_path / "ck")), hf_logits(tmp_path / "hf")
    diff = (ours - theirs).abs().max().item()
    print(f"\nMixtral export (trained at TP2): max |logit diff| = {diff:.2g}")
    assert diff < TOLERANCE and theirs.abs().max() > 0.1


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"moe_shared_expert_intermediate_size": 16}, "--moe-shared-expert-intermediate-size"),
        ({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function sigmoid"),
        ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),
        ({"moe_router_topk_scaling_factor": 2.0}, "--moe-router-topk-scaling-factor"),
        ({"moe_layer_freq": (1, 0)}, r"--moe-layer-freq \[1,0\]"),
        ({"moe_layer_freq": 2}, "--moe-layer-freq 2"),
        ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor 1.0"),
        ({"add_bias_linear": True}, "--num-experts without --disable-bias-linear"),
        ({"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
          "swiglu": False, "add_bias_linear": True, "untie_embeddings_and_output_weights": False,
          "num_query_groups": 4}, "--num-experts with learned positions"),
    ],
)  # fmt: skip
def test_what_mixtral_cannot_hold_is_refused(change: dict, flag: str) -> None:
    from megapipe.arguments import parse_args

    config = parse_args(MIXTRAL_FLAGS, 1).model
    architecture(config)  # the base is exportable
    model_fields = {k: v for k, v in change.items() if hasattr(config, k) and k != "moe"}
    moe_fields = {k: v for k, v in change.items() if k not in model_fields}
    bad = dataclasses.replace(config, **model_fields)
    bad = dataclasses.replace(bad, moe=dataclasses.replace(config.moe, **moe_fields))
    with pytest.raises(ConfigError, match=f"^{flag} has no Hugging Face equivalent: "):
        architecture(bad)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"sliding_window": 8}, "sliding_window 8: megapipe's attention is full"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1: megapipe's router has no jitter"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1: megapipe's softmax top-1 needs "
         "--moe-router-pre-softmax, which is not Mixtral's routing"),
    ],
)  # fmt: skip
def test_a_mixtral_megapipe_cannot_run_is_refused(entry, says, tmp_path: Path, capsys) -> None:
    import json

    random_mixtral(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **entry}))
    capsys.readouterr()
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"),
                "--save-dir", str(tmp_path / "mp")) != 0  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "mp").exists()
