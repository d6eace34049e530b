"""Megatron-LM's GPT-3 example runs unchanged but for sizes: the 175B script's flag set parses at
its real layout (TP 8 x PP 16, 128 ranks), and a scaled-down copy of the script trains at
TP=2 x PP=2 on 4 CPU ranks with GPT-2 BPE files, --fp16, a batch-size ramp-up, evaluation and
TensorBoard, printing Megatron's lines."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.arguments import parse_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt3_175b_distributed_cpu.sh"
LOG = re.compile(
    r"^ iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \| .*global batch size: +(\d+) \|"
)


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A byte-level BPE trained on the demo corpus's paragraphs (GPT-2's vocab.json/merges.txt
    format), and the paragraphs preprocessed with it into Megatron's .bin/.idx."""
    from tokenizers import ByteLevelBPETokenizer

    from megapipe.data.demo_corpus import demo_documents
    from megapipe.data.preprocess import PreprocessOptions, preprocess
    from megapipe.data.tokenizers import TokenizerSpec

    directory = tmp_path_factory.mktemp("gpt2")
    paragraphs = [
        p for d in demo_documents(docstrings=False) for p in d["text"].split("\n\n") if len(p) > 200
    ]
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        paragraphs, vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False
    )
    bpe.save_model(str(directory))
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    report = preprocess(
        PreprocessOptions(str(corpus), str(directory / "corpus"), spec, append_eod=True),
        show_progress=False,
    )
    return vocab, merges, report.outputs["text"]


def megatron_175b_flags(vocab: Path, merges: Path, data: str, ckpt: str, tb: str) -> list[str]:
    """The flags of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, verbatim."""
    return [
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "1536",
        "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "430000",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--data-path", data, "--vocab-file", str(vocab), "--merge-file", str(merges),
        "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", ckpt, "--load", ckpt, "--eval-iters", "10", "--tensorboard-dir", tb,
    ]  # fmt: skip


def test_the_175b_flag_set_parses_at_its_layout(gpt2_data, tmp_path: Path) -> None:
    vocab, merges, data = gpt2_data
    flags = megatron_175b_flags(vocab, merges, data, str(tmp_path / "ckpt"), str(tmp_path / "tb"))
    with pytest.warns(UserWarning):
        configs = parse_args(flags, 128)
    model, parallel, training = configs.model, configs.parallel, configs.training
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (96, 12288, 96)
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (8, 16)
    assert configs.data_parallel_size == 1
    assert training.rampup_batch_size == (16, 16, 5859375)
    assert (training.train_iters, training.lr_decay_iters, training.eval_iters) == (
        500000,
        430000,
        10,
    )
    assert configs.optimizer.fp16 and configs.optimizer.adam_beta2 == 0.95
    assert configs.data.tokenizer_type == "GPT2BPETokenizer"  # inferred from vocab + merges
    assert configs.logging.tensorboard_dir == str(tmp_path / "tb")
    # --attention-backend auto is what megapipe does: no note; --save and --load are noted
    notes = "\n".join(configs.warnings)
    assert "--attention-backend" not in notes
    assert "no checkpoint found" in notes and "training starts from scratch" in notes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_scaled_down_script_trains_at_tp2_pp2(gpt2_data, tmp_path: Path) -> None:
    vocab, merges, data = gpt2_data
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        ["bash", str(SCRIPT), str(ckpt), str(tb), str(vocab), str(merges), data],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "using world size: 4, data-parallel size: 1, tensor-model-parallel size: 2, " \
        "pipeline-model-parallel size: 2" in out  # fmt: skip
    # The ramp 2 2 24 to 8 (micro-batch 1, DP 1), by Megatron's rule: +2 every 24/3 = 8
    # samples consumed, the full batch once more than 24 were: iterations 1-4 take 2 each
    # (8 samples), 5-6 take 4 (16), 7-8 take 6 (28), then 8 each: 60 after 12, 156 after 24.
    logged = [tuple(map(int, m.groups())) for m in map(LOG.match, out.splitlines()) if m]
    assert logged == [(6, 16, 4), (12, 60, 8), (18, 108, 8), (24, 156, 8)]
    assert " validation loss at iteration 12 | lm loss value: " in out
    assert " validation loss at iteration 24 on test set | lm loss value: " in out
    # fp16 with Megatron's initial loss scale 2^32: the first iterations overflow and are skipped
    first = next(line for line in out.splitlines() if line.startswith(" iteration        6/"))
    assert "number of skipped iterations:   6" in first
    assert "loss scale: 1.0 |" not in first
    # one TensorBoard writer for the job
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    # start-up notes, once; checkpoints every --save-interval 12 and at the end
    assert run.stderr.count("no checkpoint found") == 1
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000012",
        "iter_0000024",
        "latest_checkpointed_iteration.txt",
    ]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "24"


@pytest.mark.slow
def test_a_megatron_flag_megapipe_lacks_is_refused_by_name() -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_gpt.py"),
            "--num-layers",
            "2",
            "--multi-latent-attention",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --multi-latent-attention is a Megatron-LM flag that megapipe "
        "does not support yet"
    ]
