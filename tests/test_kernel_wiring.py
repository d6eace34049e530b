"""The model with every fused kernel forced on (Triton, run by the interpreter on CPU) gives the
plain-torch model's loss and gradients: the wiring of each kernel into the layers (norms, bias
+ GeLU, SwiGLU, bias + dropout + residual with the layout-invariant keep-masks, rotary, the
unfused attention's masked softmax, the chunked cross-entropy) is the model's own math."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megapipe.config import KernelConfig, ModelConfig  # noqa: E402
from megapipe.kernels.dispatch import IMPLEMENTATIONS, KernelChoices  # noqa: E402
from megapipe.model.gpt import GPTModel  # noqa: E402
from megapipe.parallel.random import RNGTracker  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402

ALL_TRITON = KernelChoices(
    "cpu",
    {op: "triton" if "triton" in impls else "reference" for op, impls in IMPLEMENTATIONS.items()},
    {},
    IMPLEMENTATIONS,
)
GPT = {}
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "num_query_groups": 2, "untie_embeddings_and_output_weights": True}  # fmt: skip


@pytest.mark.parametrize(
    "shape, dropout, backend",
    [(GPT, 0.0, "auto"), (LLAMA, 0.0, "auto"), (GPT, 0.1, "auto"), (LLAMA, 0.0, "unfused")],
    ids=["gpt", "llama", "gpt-dropout", "llama-unfused"],
)
def test_forced_kernels_give_the_plain_models_loss_and_gradients(shape, dropout, backend):
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=40,
                         seq_length=8, max_position_embeddings=8, attention_dropout=dropout,
                         hidden_dropout=dropout, **shape)  # fmt: skip
    kernels = KernelConfig(attention_backend=backend)
    tokens = torch.randint(40, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for choices in (None, ALL_TRITON):
        model = GPTModel(config, ParallelState.single(), RNGTracker(3), seed=3, kernels=kernels,
                         kernel_choices=choices).train()  # fmt: skip
        layer = model.decoder.layers["0"]
        assert (layer.mlp.fused_activation is None) == (choices is None)  # really forced
        assert (layer.fused_bias_dropout_add is None) == (choices is None)
        loss = model(tokens=tokens, labels=tokens, sample_ids=torch.arange(2)).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_chunked_cross_entropy_flag_gives_the_same_loss_on_cpu() -> None:
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=40,
                         seq_length=8, max_position_embeddings=8, attention_dropout=0.0,
                         hidden_dropout=0.0)  # fmt: skip
    tokens = torch.randint(40, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for fusion in (False, True):
        model = GPTModel(config, ParallelState.single(), RNGTracker(3), seed=3,
                         kernels=KernelConfig(cross_entropy_loss_fusion=fusion))  # fmt: skip
        assert model.fused_cross_entropy is None  # CPU: the torch chunked path, not Triton
        losses.append(model(tokens=tokens, labels=tokens))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
