"""Model presets: the GPT-3 sizes and the models of Megatron-LM's weak-scaling table.

GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (layers, d_model,
heads; seq 2048; the GPT-2 BPE vocabulary of 50257). Two entries are adjusted as Megatron-LM's
own configs do: XL (1.3B) has 16 heads of 128 (the table's 24 heads x 128 != 2048) and 13B a
hidden size of 5120 (the table's 5140 does not divide by its 40 heads).

Megatron-LM: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: vocabulary 51,200, sequence 2048, with
the (TP, PP), GPU count, batch size and achieved TFLOP/s per GPU it reports, on Selene's DGX
A100 nodes (8x 80 GB, NVLink, 8x 200 Gb/s InfiniBand).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import ModelConfig, MoEConfig


def gpt(layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 2048) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       vocab_size=vocab, seq_length=seq)  # fmt: skip


GPT3: dict[str, ModelConfig] = {
    "gpt3-125m": gpt(12, 768, 12),
    "gpt3-350m": gpt(24, 1024, 16),
    "gpt3-760m": gpt(24, 1536, 16),
    "gpt3-1.3b": gpt(24, 2048, 16),
    "gpt3-2.7b": gpt(32, 2560, 32),
    "gpt3-6.7b": gpt(32, 4096, 32),
    "gpt3-13b": gpt(40, 5120, 40),
    "gpt3-175b": gpt(96, 12288, 96),
}


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al. 2021, Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, by the paper's equation (3) (recomputation counted)
    percent_of_peak: int

    @property
    def model(self) -> ModelConfig:
        return gpt(self.layers, self.hidden, self.heads, vocab=51200)

    @property
    def name(self) -> str:
        return f"megatron-{self.billions:g}b"


# Transcribed from the paper's Table 1 (the text of the 1T row: 163 TFLOP/s per GPU, 52% of
# peak, 502 PFLOP/s aggregate on 3072 GPUs, (t, p, d) = (8, 64, 6)).
MEGATRON_WEAK_SCALING: tuple[PublishedRun, ...] = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)

# GPT-3's batch sizes (Table 2.1, in tokens: 0.5M, 0.5M, 0.5M, 1M, 1M, 2M, 2M, 3.2M) as
# sequences of 2048; 175B's 3.2M tokens as Megatron-LM's GPT-3 175B config rounds it (1536).
GPT3_BATCH: dict[str, int] = {
    "gpt3-125m": 256,
    "gpt3-350m": 256,
    "gpt3-760m": 256,
    "gpt3-1.3b": 512,
    "gpt3-2.7b": 512,
    "gpt3-6.7b": 1024,
    "gpt3-13b": 1024,
    "gpt3-175b": 1536,
}


def published_batch(preset: str | None) -> int | None:
    """The global batch (sequences) a preset's paper trained with; None without a preset."""
    runs = {run.name: run.batch for run in MEGATRON_WEAK_SCALING}
    return GPT3_BATCH.get(preset) or runs.get(preset) if preset else None


def mixtral(layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> ModelConfig:
    """A Mixtral-style MoE: 8 SwiGLU experts top-2 on every layer, GQA with 8 groups, rope,
    RMSNorm, no biases, untied embeddings; 4,096-token training sequences."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=8, vocab_size=vocab, seq_length=4096,
                       max_position_embeddings=4096, ffn_hidden_size=ffn, swiglu=True,
                       position_embedding_type="rope", normalization="RMSNorm",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True,
                       moe=MoEConfig(num_experts=8, moe_router_topk=2))  # fmt: skip


# Mistral AI's Mixtral 8x7B (46.7B parameters, 12.9B active) and 8x22B (141B, 39B active):
# the shapes of their published Hugging Face configs (config.json), sequences of 4,096 tokens.
MOE: dict[str, ModelConfig] = {
    "mixtral-8x7b": mixtral(32, 4096, 32, 14336, 32000),
    "mixtral-8x22b": mixtral(56, 6144, 48, 16384, 32768),
}

MODELS: dict[str, ModelConfig] = {
    **GPT3,
    **{run.name: run.model for run in MEGATRON_WEAK_SCALING},
    **MOE,
}
