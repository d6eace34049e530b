"""Hugging Face export and import (`tools/checkpoint/convert.py --saver hf / --loader hf`):
a megapipe model trained 2 steps exported loads in transformers with megapipe's logits (GPT-2
and Llama shapes), a random transformers model imported gives its own logits in megapipe,
export -> import round-trips bit-exactly, and a flag combination with no transformers
equivalent is refused with a line naming it."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.convert import Source, _fill, build_rank, read_source, resolve
from megapipe.checkpointing.hf_export import architecture
from megapipe.errors import ConfigError
from tests.test_checkpoint_resume import MOCK, MODEL, NO_DROPOUT, run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("convert_tool", ROOT / "tools/checkpoint/convert.py")
convert_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_tool)

LLAMA = [
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization",
    "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2",
]  # fmt: skip
SHAPES = {"gpt2": [], "llama": LLAMA}
TOKENS = torch.tensor([[5, 17, 99, 0, 42, 8, 3, 64, 11, 27, 90, 1, 2, 33, 71, 50]] * 2)
TOKENS[1] = TOKENS[1].flip(0)


def tool(*argv: str) -> int:
    return convert_tool.main(["--model-type", "GPT", *argv])


def weights(load_dir: Path) -> Source:
    return read_source(resolve(str(load_dir))[0], say=lambda _: None)


def megapipe_logits(source: Source) -> torch.Tensor:
    config = source.config
    (model,) = build_rank(config, 0, 1, 0, [range(config.num_layers)], 1)
    _fill([model], source, 0, 1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens=TOKENS)  # [s, b, padded vocab]
    return logits.transpose(0, 1)[..., : config.vocab_size].float()


def hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def trained(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    flags = MODEL + MOCK + NO_DROPOUT + SHAPES[request.param]
    run(1, flags + ["--train-iters", "2", "--save", str(root / "ckpt")])
    return request.param, root


def test_export_loads_in_transformers_with_megapipe_logits(trained) -> None:
    kind, root = trained
    hf = root / "hf"
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(hf)) == 0
    assert (root / "hf" / "config.json").exists() and (root / "hf" / "model.safetensors").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"))
    expected = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
    assert type(model).__name__ == expected
    ours, theirs = megapipe_logits(weights(root / "ckpt")), hf_logits(root / "hf")
    diff = (ours - theirs).abs().max().item()
    print(f"\n{kind}: export max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


def test_export_import_round_trips_bit_exactly(trained) -> None:
    kind, root = trained
    hf = root / "hf_rt"
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(hf)) == 0
    for tp, name in ((1, "back"), (2, "back_tp2")):
        back = root / name
        assert tool("--loader", "hf", "--load-dir", str(hf), "--save-dir", str(back),
                    "--target-tensor-parallel-size", str(tp)) == 0  # fmt: skip
        source, other = weights(root / "ckpt"), weights(back)
        assert sorted(other.tensors) == sorted(source.tensors), kind
        for key, tensor in source.tensors.items():
            assert torch.equal(other.tensors[key], tensor), (kind, key)
        assert other.config == dataclasses.replace(
            source.config, attention_dropout=0.0, hidden_dropout=0.0,
            make_vocab_size_divisible_by=other.config.make_vocab_size_divisible_by,
        )  # fmt: skip


def _random_hf(kind: str, directory: Path) -> None:
    torch.manual_seed(0)
    if kind.startswith("gpt2"):  # GPT-2's default activation is gelu_new (tanh): --openai-gelu
        config = transformers.GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **({"activation_function": "gelu"} if kind == "gpt2-exact-gelu" else {}),
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # layer norms off their 1/0 init, so they are checked too
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(directory))


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-exact-gelu", "llama"])
def test_imported_transformers_model_gives_its_logits(kind: str, tmp_path: Path) -> None:
    _random_hf(kind, tmp_path / "hf")
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"),
                "--save-dir", str(tmp_path / "mp")) == 0  # fmt: skip
    imported = weights(tmp_path / "mp")
    assert imported.config.openai_gelu == (kind == "gpt2")
    ours, theirs = megapipe_logits(imported), hf_logits(tmp_path / "hf")
    diff = (ours - theirs).abs().max().item()
    print(f"\n{kind}: import max |logit diff| = {diff:.3g}")
    assert diff < 1e-4


def test_combination_without_transformers_equivalent_is_refused(trained, capsys) -> None:
    kind, root = trained
    config = weights(root / "ckpt").config
    if kind == "gpt2":
        bad = dataclasses.replace(config, normalization="RMSNorm")
        with pytest.raises(ConfigError, match="--normalization RMSNorm with learned positions"):
            architecture(bad)
    else:
        bad = dataclasses.replace(config, swiglu=False, ffn_hidden_size=64)
        with pytest.raises(ConfigError, match="rotary positions without --swiglu"):
            architecture(bad)
    other = root / "not_hf"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    assert tool("--loader", "hf", "--load-dir", str(other), "--save-dir", str(root / "x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'bert'" in err[0]
