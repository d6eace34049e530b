"""Hugging Face export and import (`tools/checkpoint/convert.py --saver hf / --loader hf`).

A megapipe model trained 2 steps at TP=2 x PP=2 and exported loads in transformers with
megapipe's logits (GPT-2, GPT-2 with --openai-gelu, Llama shapes); sharded exports load the
same and match transformers' own shard split; random transformers models imported (GPT-2's
default tanh GeLU and the exact one, Llama from transformers' own sharded save) give their own
logits in megapipe; export -> import round-trips bit-exactly. Bad input (a flag combination
or architecture with no counterpart, a missing, misshapen or extra tensor, a bad shard size,
an occupied --save-dir, a crash mid-export) is one line naming it, a non-zero exit, and
nothing at --save-dir that looks loadable.

Measured max |logit diff| (CPU, torch 2.13, transformers 5.24; the tests print them): export
gpt2 0, gpt2-openai-gelu 1.8e-6 (larger logits from its wider init; 1.6e-3 when transformers
runs the exact "gelu" instead, the control), llama 6.0e-8; import gpt2 (gelu_new) 3.0e-8, gpt2
with the exact gelu 0, llama 4.5e-8.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.hf_safetensors import INDEX, WEIGHTS, parse_size, plan_shards
from megapipe.conversion.convert import Source, _fill, build_rank, read_source, resolve
from megapipe.conversion.hf_export import architecture, export_source
from megapipe.errors import ConfigError
from tests.helpers import MOCK, MODEL, NO_DROPOUT, random_hf_model, run
from tests.helpers import convert_gpt as tool

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


LLAMA = [
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization",
    "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2",
]  # fmt: skip
# A wider init puts the MLP's inputs at |x| ~ 1, where the tanh GeLU differs from the exact one.
CASES = {
    "gpt2": [],
    "gpt2-openai-gelu": ["--openai-gelu", "--init-method-std", "0.3"],
    "llama": LLAMA,
}
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TOLERANCE = 1e-4
TOKENS = torch.tensor([[5, 17, 99, 0, 42, 8, 3, 64, 11, 27, 90, 1, 2, 33, 71, 50]] * 2)
TOKENS[1] = TOKENS[1].flip(0)


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


def hf_logits(directory: Path, **overrides) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, **overrides
    )
    model.eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.fixture(scope="module", params=sorted(CASES))
def trained(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A model of each case trained 2 steps at TP=2 x PP=2 (4 gloo ranks), and its export."""
    root = tmp_path_factory.mktemp(request.param)
    flags = MODEL + MOCK + NO_DROPOUT + TP2_PP2 + CASES[request.param]
    run(4, flags + ["--train-iters", "2", "--save", str(root / "ckpt")])
    assert (
        tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(root / "hf")) == 0
    )
    return request.param, root


def test_export_loads_in_transformers_with_megapipe_logits(trained) -> None:
    kind, root = trained
    hf = root / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", WEIGHTS]  # no tokenizer: mock
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    expected = "LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"
    assert type(model).__name__ == expected
    ours, theirs = megapipe_logits(weights(root / "ckpt")), hf_logits(hf)
    diff = (ours - theirs).abs().max().item()
    print(f"\n{kind} (trained at TP2 x PP2): export max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE
    if kind.startswith("gpt2"):
        activation = json.loads((hf / "config.json").read_text())["activation_function"]
        assert activation == ("gelu_new" if kind == "gpt2-openai-gelu" else "gelu")
    if kind == "gpt2-openai-gelu":  # control: the comparison sees the GeLU's approximation
        exact = (ours - hf_logits(hf, activation_function="gelu")).abs().max().item()
        print(f"{kind}: with transformers' exact gelu instead, max |logit diff| = {exact:.3g}")
        assert exact > 10 * TOLERANCE


def test_export_import_round_trips_bit_exactly(trained) -> None:
    kind, root = trained
    for tp, name in ((1, "back"), (2, "back_tp2")):
        back = root / name
        assert tool("--loader", "hf", "--load-dir", str(root / "hf"), "--save-dir", str(back),
                    "--target-tensor-parallel-size", str(tp)) == 0  # fmt: skip
        source, other = weights(root / "ckpt"), weights(back)
        assert sorted(other.tensors) == sorted(source.tensors), kind
        for key, tensor in source.tensors.items():
            assert torch.equal(other.tensors[key], tensor), (kind, key)
        assert other.config == dataclasses.replace(
            source.config, attention_dropout=0.0, hidden_dropout=0.0,
            make_vocab_size_divisible_by=other.config.make_vocab_size_divisible_by,
            init_method_std=other.config.init_method_std,  # not a weight: not in config.json
        )  # fmt: skip


# --- sharded safetensors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2000000", 2 * 10**6), ("1.5 GiB", 3 * 2**29),
     ("20kb", 20_000), (4096, 4096)],
)  # fmt: skip
def test_shard_sizes_read_as_transformers_reads_them(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-5MB", "5XB", "GB", "1e9"])
def test_a_bad_shard_size_is_refused(text) -> None:
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size(text)


@pytest.mark.parametrize("max_shard_size", [10**9, 100])
def test_weights_get_the_mode_of_the_exports_other_files(max_shard_size, tmp_path) -> None:
    """safetensors creates its files 0600; an export's weights read like its config.json."""
    from megapipe.checkpointing.hf_safetensors import write_weights

    (tmp_path / "config.json").write_text("{}")
    tensors = {"a": torch.zeros(20), "b": torch.ones(20)}
    files = write_weights(tensors, str(tmp_path), max_shard_size)
    assert len(files) == (1 if max_shard_size > 100 else 3)
    expected = (tmp_path / "config.json").stat().st_mode & 0o777
    assert {name: (tmp_path / name).stat().st_mode & 0o777 for name in files} == dict.fromkeys(
        files, expected
    )


def test_shards_are_cut_as_transformers_cuts_them(trained) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    _, root = trained
    tensors = safetensors_torch.load_file(str(root / "hf" / WEIGHTS))
    for limit in (3000, 20_000, 10**9):
        split = split_torch_state_dict_into_shards(
            tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
        )
        assert plan_shards(tensors, limit) == list(split.filename_to_tensors.values())


def test_sharded_export_loads_with_the_same_logits_and_round_trips(trained) -> None:
    kind, root = trained
    sharded, limit = root / "hf_sharded", 10_000
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(sharded),
                "--max-shard-size", "10KB") == 0  # fmt: skip
    index = json.loads((sharded / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / WEIGHTS).exists()
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, 1 + len(files))
    ]
    assert sorted(p.name for p in sharded.iterdir()) == sorted([*files, INDEX, "config.json"])
    held = {f: safetensors_torch.load_file(str(sharded / f)) for f in files}
    assert sorted(n for t in held.values() for n in t) == sorted(index["weight_map"])
    sizes = {f: sum(t.numel() * t.element_size() for t in held[f].values()) for f in files}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for file, shard in held.items():  # within the limit, or one tensor above it alone
        assert sizes[file] <= limit or len(shard) == 1, (file, sizes[file], sorted(shard))
    assert any(sizes[f] > limit for f in files)  # the MLP weights (16 KB) are bigger
    assert torch.equal(hf_logits(sharded), hf_logits(root / "hf"))
    back = root / "back_sharded"
    assert tool("--loader", "hf", "--load-dir", str(sharded), "--save-dir", str(back)) == 0
    source, other = weights(root / "ckpt"), weights(back)
    assert all(torch.equal(other.tensors[k], t) for k, t in source.tensors.items()), kind


# --- import of transformers' own models -----------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-exact-gelu", "llama"])
def test_imported_transformers_model_gives_its_logits(kind: str, tmp_path: Path) -> None:
    random_hf_model(kind, tmp_path / "hf")
    assert (tmp_path / "hf" / INDEX).exists() == (kind == "llama")
    assert tool("--loader", "hf", "--load-dir", str(tmp_path / "hf"),
                "--save-dir", str(tmp_path / "mp")) == 0  # fmt: skip
    imported = weights(tmp_path / "mp")
    assert imported.config.openai_gelu == (kind == "gpt2")
    ours, theirs = megapipe_logits(imported), hf_logits(tmp_path / "hf")
    diff = (ours - theirs).abs().max().item()
    print(f"\n{kind}: import max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE


# --- bad input ------------------------------------------------------------------------------


def test_combination_without_transformers_equivalent_is_refused(trained, tmp_path) -> None:
    kind, root = trained
    source = weights(root / "ckpt")
    if kind == "llama":
        bad = dataclasses.replace(source.config, swiglu=False, ffn_hidden_size=64)
        with pytest.raises(ConfigError, match="rotary positions without --swiglu"):
            architecture(bad)
    else:
        bad = dataclasses.replace(source.config, normalization="RMSNorm")
        with pytest.raises(ConfigError, match="--normalization RMSNorm with learned positions"):
            architecture(bad)
    with pytest.raises(ConfigError):
        export_source(dataclasses.replace(source, config=bad), str(tmp_path / "out"), print)
    assert list(tmp_path.iterdir()) == []  # not even a temporary directory


ONE_MODEL = pytest.mark.parametrize("trained", ["gpt2"], indirect=True)  # enough for bad input


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _bad_copy(source: Path, target: Path, config=None, tensors=None) -> Path:
    """A copy of the exported directory `source` with config.json or the tensors changed."""
    target.mkdir()
    hf = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config(hf) if config else hf))
    held = safetensors_torch.load_file(str(source / WEIGHTS))
    safetensors_torch.save_file(tensors(held) if tensors else held, str(target / WEIGHTS))
    return target


def _without(name: str):
    return lambda t: {k: v for k, v in t.items() if k != name}


BAD_GPT2 = {
    "another architecture": (
        lambda hf: {"model_type": "bert", "architectures": ["BertModel"]}, None,
        "model_type 'bert'",
    ),
    "another head": (
        lambda hf: {**hf, "architectures": ["GPT2ForSequenceClassification"]}, None,
        "architectures ['GPT2ForSequenceClassification']",
    ),
    "an activation megapipe lacks": (
        lambda hf: {**hf, "activation_function": "relu"}, None, "activation_function 'relu'",
    ),
    "config.json lacking a size": (
        lambda hf: {k: v for k, v in hf.items() if k != "n_embd"}, None, "n_embd",
    ),
    "sizes megapipe refuses": (
        lambda hf: {**hf, "n_head": 5}, None, "--num-attention-heads (5)",
    ),
    "a missing tensor": (None, _without("transformer.h.1.mlp.c_fc.bias"),
                         "tensor transformer.h.1.mlp.c_fc.bias is missing"),
    "a layer more in config.json": (
        lambda hf: {**hf, "n_layer": hf["n_layer"] + 1}, None,
        "tensor transformer.h.4.ln_1.weight is missing",
    ),
    "a tensor of another shape": (
        None, lambda t: {**t, "transformer.h.0.attn.c_attn.weight": torch.zeros(32, 64)},
        "tensor transformer.h.0.attn.c_attn.weight has shape (32, 64), config.json's sizes "
        "need (32, 96)",
    ),
    "a tensor left over": (
        None, lambda t: {**t, "transformer.h.0.attn.extra.weight": torch.zeros(2)},
        "tensor transformer.h.0.attn.extra.weight has no place",
    ),
    "an untied output layer": (
        None, lambda t: {**t, "lm_head.weight": t["transformer.wte.weight"] + 1},
        "tensor lm_head.weight differs from transformer.wte.weight",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_GPT2))
@ONE_MODEL
def test_bad_hugging_face_input_is_one_line_and_writes_nothing(case, trained, tmp_path, capsys):
    kind, root = trained
    config, tensors, says = BAD_GPT2[case]
    bad = _bad_copy(root / "hf", tmp_path / "bad", config, tensors)
    capsys.readouterr()
    assert tool("--loader", "hf", "--load-dir", str(bad), "--save-dir", str(tmp_path / "mp")) == 2
    line = _one_error_line(capsys)
    assert says in line and str(bad) in line, line
    assert not (tmp_path / "mp").exists()


@ONE_MODEL
def test_a_corrupt_shard_and_a_broken_index_are_named(trained, tmp_path, capsys) -> None:
    kind, root = trained
    bad = tmp_path / "bad"
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(bad),
                "--max-shard-size", "20KB") == 0  # fmt: skip
    index = json.loads((bad / INDEX).read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    (bad / second).write_bytes(b"not safetensors")
    capsys.readouterr()
    assert tool("--loader", "hf", "--load-dir", str(bad), "--save-dir", str(tmp_path / "mp")) == 2
    assert f"{second}: not a readable safetensors file" in _one_error_line(capsys)
    (bad / second).unlink()
    assert tool("--loader", "hf", "--load-dir", str(bad), "--save-dir", str(tmp_path / "mp")) == 2
    assert f"{second}: missing" in _one_error_line(capsys)
    (bad / INDEX).write_text("{")
    assert tool("--loader", "hf", "--load-dir", str(bad), "--save-dir", str(tmp_path / "mp")) == 2
    assert f"{INDEX}: malformed" in _one_error_line(capsys)
    assert not (tmp_path / "mp").exists()


@ONE_MODEL
def test_a_target_layout_that_does_not_fit_is_refused(trained, tmp_path, capsys) -> None:
    kind, root = trained
    capsys.readouterr()
    mp = str(tmp_path / "mp")
    assert tool("--loader", "hf", "--load-dir", str(root / "hf"), "--save-dir", mp,
                "--target-tensor-parallel-size", "3") == 2  # fmt: skip
    assert "--target-tensor-parallel-size 3 does not divide" in _one_error_line(capsys)
    assert not (tmp_path / "mp").exists()


@ONE_MODEL
def test_export_never_leaves_a_directory_that_looks_loadable(trained, tmp_path, capsys) -> None:
    kind, root = trained
    out = tmp_path / "out"
    capsys.readouterr()
    assert tool("--saver", "hf", "--load-dir", str(root / "ckpt"), "--save-dir", str(out),
                "--max-shard-size", "5XB") == 2  # fmt: skip
    assert "--max-shard-size '5XB'" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []

    def crash(line: str) -> None:  # a failure in the middle of writing (the tokenizer step)
        if "tokenizer" in line:
            raise OSError("disk full")

    source = weights(root / "ckpt")
    with pytest.raises(OSError, match="disk full"):
        export_source(source, str(out), crash)
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its temporary sibling
    export_source(source, str(out), print)
    before = hf_logits(out)
    with pytest.raises(OSError, match="disk full"):
        export_source(source, str(out), crash, max_shard_size="20KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the earlier export, intact
    assert torch.equal(hf_logits(out), before) and not (out / INDEX).exists()

    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a Hugging Face directory"):
        export_source(source, str(other), print)
    assert [p.name for p in other.iterdir()] == ["mine.txt"]
