"""--attention-backend: unfused/local and flash (SDPA's CPU flash kernel here) give the logits
and gradients of auto, with GQA, rotary and a KV cache; training losses match; a forced
backend that cannot run here, or cannot take megapipe's dropout masks or a per-document mask,
is one line naming the flag; --use-flash-attn and --transformer-impl are checked too."""

from __future__ import annotations

import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.config import KernelConfig, ModelConfig
from megapipe.errors import ConfigError
from megapipe.model.attention_backends import check_attention_backend
from megapipe.model.gpt import GPTModel
from megapipe.model.kv_cache import KVCache
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.testing import run_distributed, train_with_flags

CONFIG = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
    max_position_embeddings=16, attention_dropout=0.0, hidden_dropout=0.0,
    position_embedding_type="rope", num_query_groups=2,
)  # fmt: skip


def _model(backend: str) -> GPTModel:
    return GPTModel(CONFIG, ParallelState.single(), RNGTracker(1), seed=1,
                    kernels=KernelConfig(attention_backend=backend))  # fmt: skip


@pytest.mark.parametrize("backend", ["unfused", "local", "flash"])
def test_backends_give_autos_logits_and_gradients(backend: str) -> None:
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in ("auto", backend):
        model = _model(name).train()
        loss = model(tokens=tokens, labels=tokens).mean()
        loss.backward()
        results[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    (auto_loss, auto_grads), (loss, grads) = results["auto"], results[backend]
    torch.testing.assert_close(loss, auto_loss, rtol=1e-6, atol=1e-6)
    for name, grad in auto_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6)


def test_unfused_attention_over_a_kv_cache_equals_the_full_forward() -> None:
    model = _model("unfused").eval()
    tokens = torch.randint(64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens=tokens)
        cache = KVCache(2, 16)
        steps = [model(tokens=tokens[:, :6], kv_cache=cache)]
        cache.advance(6)
        for i in range(6, 10):
            steps.append(model(tokens=tokens[:, i : i + 1], kv_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)


def test_forced_backends_that_cannot_run_are_one_line() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ConfigError, match="--attention-backend fused: not available on cpu"):
        check_attention_backend("fused", cpu, f32, attention_dropout=0, reset_attention_mask=False)
    with pytest.raises(ConfigError, match="cannot apply megapipe's layout-invariant attention"):
        check_attention_backend("flash", cpu, f32, attention_dropout=0.1,
                                reset_attention_mask=False)  # fmt: skip
    with pytest.raises(ConfigError, match="--attention-backend flash takes no attention mask"):
        check_attention_backend("flash", cpu, f32, attention_dropout=0, reset_attention_mask=True)
    for ok in ("auto", "flash", "unfused", "local"):  # these run on this CPU
        check_attention_backend(ok, cpu, f32, attention_dropout=0, reset_attention_mask=False)


ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3", "--eval-iters", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _losses(rank: int, world: int, argv: list[str]) -> list[float]:
    return [r.lm_loss for r in train_with_flags(rank, world, argv)[0]]


def test_training_with_the_unfused_backend_matches_auto_at_tp2() -> None:
    tp2 = ["--tensor-model-parallel-size", "2"]
    auto = run_distributed(_losses, 2, ARGV + tp2)[0]
    unfused = run_distributed(_losses, 2, ARGV + tp2 + ["--attention-backend", "unfused"])[0]
    assert max(abs(a - b) / a for a, b in zip(auto, unfused)) < 1e-5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-flash-attn", "--attention-backend", "unfused"],
         "--use-flash-attn contradicts --attention-backend unfused"),
        (["--transformer-impl", "transformer_engine"],
         "--transformer-impl transformer_engine: TransformerEngine is not installed"),
    ],
)  # fmt: skip
def test_contradictory_or_missing_implementations_are_named(flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(ARGV + flags, 1)


def test_use_flash_attn_means_the_flash_backend() -> None:
    assert parse_args(ARGV + ["--use-flash-attn"], 1).kernels.attention_backend == "flash"
    configs = parse_args(ARGV + ["--no-bias-gelu-fusion", "--cross-entropy-loss-fusion"], 1)
    assert not configs.kernels.bias_gelu_fusion and configs.kernels.cross_entropy_loss_fusion
    assert configs.kernels.bias_dropout_fusion


def test_pretrain_gpt_refuses_a_forced_backend_missing_here_with_status_2(capsys) -> None:
    import pretrain_gpt

    assert pretrain_gpt.main(ARGV + ["--attention-backend", "fused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pretrain_gpt.py: error: --attention-backend fused: not available")
    assert not any("Traceback" in line for line in err)
