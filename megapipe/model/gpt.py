"""The GPT model, buildable as the slice of layers one pipeline stage owns.

Activations flow as [sequence, batch, hidden] (sequence-sharded under sequence parallelism).
Parameter names are global: layer i is `decoder.layers.i` whichever stage holds it, which keeps
initialisation, checkpoints and parity checks layout-independent.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from megapipe.config import KernelConfig, ModelConfig, RecomputeConfig
from megapipe.kernels.cross_entropy import chunked_cross_entropy
from megapipe.kernels.dispatch import KernelChoices
from megapipe.layers.cross_entropy import vocab_parallel_cross_entropy
from megapipe.layers.embedding import VocabParallelEmbedding, vocab_range
from megapipe.layers.linear import ColumnParallelLinear
from megapipe.layers.norms import build_norm
from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.model.dropout import EMBEDDING_LAYER, LogicalDropout
from megapipe.model.fused_ops import fused
from megapipe.model.fused_ops import kernel_choices as kernel_choices_for
from megapipe.model.initialization import initialize_parameters
from megapipe.model.kv_cache import KVCache
from megapipe.model.moe_losses import MoELosses
from megapipe.model.recompute import recompute, recomputed_groups, wanted
from megapipe.model.rotary import RotaryEmbedding
from megapipe.model.te_layers import chunk_fp8_scope
from megapipe.model.transformer_layer import TransformerLayer
from megapipe.parallel.mappings import scatter_to_sequence_parallel_region
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class LanguageEmbedding(torch.nn.Module):
    """Word (+ learned position) embeddings -> [s, b, h], sequence-scattered under SP."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        rng: RNGTracker,
        padded_vocab: int,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.tp, self.rng = tp, rng
        self.sequence_parallel = sequence_parallel
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab,
            config.hidden_size,
            tp,
            init_std=config.init_method_std,
            vocab_size=config.vocab_size,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size
            )
            self.position_embeddings.weight = make_param(
                ParamMeta(
                    (config.max_position_embeddings, config.hidden_size),
                    init_std=config.init_method_std,
                ),
                1,
            )

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        dropout_masks: LogicalDropout | None = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h], complete on every TP rank
        if self.position_embeddings is not None:
            if position_ids is None:
                x = x + self.position_embeddings.weight[: tokens.shape[1]]
            else:
                x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp)
        if self.training and self.dropout > 0:
            if dropout_masks is not None:
                return dropout_masks.hidden(x, self.dropout, EMBEDDING_LAYER, "embedding")
            with self.rng.fork() if self.sequence_parallel else contextlib.nullcontext():
                x = F.dropout(x, self.dropout, training=True)
        return x


class Decoder(torch.nn.Module):
    """The transformer layers this stage owns (keyed by global index) and the final norm."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        rng: RNGTracker,
        layers: range,
        final_norm: bool,
        sequence_parallel: bool,
        recompute: RecomputeConfig | None = None,
        kernels: KernelConfig | None = None,
        choices: KernelChoices | None = None,
        cp: Group | None = None,
        moe_losses: MoELosses | None = None,
        ep: Group | None = None,
    ) -> None:
        super().__init__()
        recompute = recompute or RecomputeConfig()
        self.rng = rng
        self.sequence_parallel = sequence_parallel
        self.fp8 = chunk_fp8_scope(kernels, tp)  # entered once per forward, around the layers
        self.layers = torch.nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    config,
                    tp,
                    rng,
                    sequence_parallel=sequence_parallel,
                    layer_number=i,
                    recompute=recompute,
                    kernels=kernels,
                    choices=choices,
                    fp8_scope=self.fp8,
                    cp=cp,
                    moe_losses=moe_losses,
                    ep=ep,
                )
                for i in layers
            }
        )
        self.recomputed = recomputed_groups(recompute, len(layers))  # full recomputation
        self.final_layernorm = (
            build_norm(
                config.normalization,
                config.hidden_size,
                config.layernorm_epsilon,
                sequence_parallel,
                fused(choices, "layer_norm" if config.normalization == "LayerNorm" else "rms_norm"),
            )
            if final_norm
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None,
        attention_mask: torch.Tensor | None = None,
        dropout_masks: LogicalDropout | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        # Without dropout_masks, dropout draws from the rank's streams: under SP every
        # activation is a per-rank shard, so all of it draws from the TP stream.
        layers = list(self.layers.values())
        groups = {g.start: g for g in self.recomputed} if wanted(self) else {}

        def run(x: torch.Tensor, mask: torch.Tensor | None, group: range) -> torch.Tensor:
            for i in group:
                x = layers[i](x, rotary, mask, dropout_masks, kv_cache)
            return x

        fork = self.rng.fork() if self.sequence_parallel else contextlib.nullcontext()
        with self.fp8(), fork:
            i = 0
            while i < len(layers):
                group = groups.get(i, range(i, i + 1))
                if i in groups:  # in backward, outside this scope: enters it once again
                    x = recompute(self.fp8.wrap(run), x, attention_mask, group, rng=self.rng)
                else:
                    x = run(x, attention_mask, group)
                i = group.stop
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x


class GPTModel(torch.nn.Module):
    """Pre-norm decoder-only transformer, or the part of it one pipeline stage owns.

    layers: the global indices of the transformer layers this stage holds (default: all).
    The first stage (layers start at 0) holds the embedding, the last the final norm and output
    layer. With tied embeddings the last stage of a pipeline holds its own copy of the word
    embedding, initialised to the same values (the pipeline keeps their grads in sync).
    """

    def __init__(
        self,
        config: ModelConfig,
        state: ParallelState,
        rng: RNGTracker,
        *,
        seed: int,
        sequence_parallel: bool = False,
        layers: range | None = None,
        recompute: RecomputeConfig | None = None,
        kernels: KernelConfig | None = None,
        kernel_choices: KernelChoices | None = None,
    ) -> None:
        """kernels: the fusion and attention flags; kernel_choices: the fused implementations
        to use (default: chosen from `kernels` for the device: plain torch on CPU)."""
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        choices = kernel_choices or kernel_choices_for(kernels, state.device)
        self.kernel_choices = choices
        self.cross_entropy_fusion = (kernels or KernelConfig()).cross_entropy_loss_fusion
        self.fused_cross_entropy = fused(choices, "cross_entropy")
        tp = state.tp
        self.config = config
        self.rng = rng  # this rank's random streams (checkpoints save and restore them)
        self.seed = seed  # also keys the dropout masks (model/dropout.py)
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.pre_process = layers.start == 0
        self.post_process = layers.stop == config.num_layers
        self.padded_vocab_size = config.padded_vocab_size(tp.size)
        self.vocab_start = vocab_range(self.padded_vocab_size, tp.rank, tp.size)[0]

        self.embedding = (
            LanguageEmbedding(config, tp, rng, self.padded_vocab_size, self.sequence_parallel)
            if self.pre_process
            else None
        )
        self.rotary = (
            RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                config.rotary_base,
                fused(choices, "rotary"),
                rotary_dim=config.rotary_dim,
            )
            if config.position_embedding_type == "rope"
            else None
        )
        # the MoE layers' auxiliary losses of the current step (None: a dense model)
        self.moe_losses = MoELosses(config.num_layers) if config.moe is not None else None
        self.decoder = Decoder(
            config,
            tp,
            rng,
            layers,
            self.post_process,
            self.sequence_parallel,
            recompute,
            kernels,
            choices,
            state.cp,
            self.moe_losses,
            state.ep,
        )
        self.cp = state.cp  # context parallelism: this rank holds its chunks of each sequence
        self.output_layer = None
        if self.post_process:
            tied = not config.untie_embeddings_and_output_weights
            weight = self.embedding.word_embeddings.weight if tied and self.pre_process else None
            if weight is None:
                weight = make_param(
                    ParamMeta(
                        (self.padded_vocab_size, config.hidden_size),
                        tp_dim=0,
                        init_std=config.init_method_std,
                        init_rows=config.vocab_size,
                        copy_of=WORD_EMBEDDING if tied else None,
                    ),
                    tp.size,
                )
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                tp,
                init_std=config.init_method_std,
                bias=False,
                sequence_parallel=self.sequence_parallel,
                weight=weight,
            )
        self._mark_embedding_and_output()
        initialize_parameters(self, seed, tp.rank, tp.size, state.ep.rank, state.ep.size)
        self.to(state.device)

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        sample_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """First stage: `tokens` [b, s]; later stages: `hidden_states` [s, b, h].

        attention_mask: None for causal attention, else [b, 1, s, s] bool, True = may attend
        (every stage needs it: --reset-attention-mask).

        sample_ids: int64 [b], the global indices of the micro-batch's samples. In training
        with dropout they key every dropout mask (model/dropout.py), which makes dropout the
        same whatever the TP/PP/DP layout; without them dropout draws from the rank's random
        streams (parallel/random.py). Ignored in eval mode and when both dropouts are 0.

        kv_cache: generation (megapipe/inference). The tokens sit at positions
        kv_cache.offset..; this stage's layers add their keys and values to the cache and
        attend over all of it. The caller advances the cache once the step is done.

        Returns hidden states [s, b, h] before the last stage; on the last stage the
        vocabulary-parallel logits [s, b, vocab/tp], or the per-token loss [b, s] when
        `labels` [b, s] are given. Logits of padding ids (>= vocab_size) are returned as
        computed but never enter the loss; samplers must ignore them too.
        """
        masks = self._dropout_masks(sample_ids)
        if kv_cache is not None and position_ids is None and self.pre_process:
            start = kv_cache.offset
            position_ids = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            position_ids = position_ids.expand(tokens.shape[0], -1)
        if self.pre_process:
            hidden_states = self.embedding(tokens, position_ids, masks)
        x = self.decoder(hidden_states, self.rotary, attention_mask, masks, kv_cache)
        if not self.post_process:
            return x
        logits, _ = self.output_layer(x)
        if labels is None:
            return logits
        cross_entropy = vocab_parallel_cross_entropy
        if self.fused_cross_entropy is not None:
            cross_entropy = self.fused_cross_entropy
        elif self.cross_entropy_fusion:  # the chunked form saves memory on any device
            cross_entropy = chunked_cross_entropy
        loss = cross_entropy(logits, labels.t(), self.tp, self.vocab_start, self.config.vocab_size)
        # a copy, not a view ([b, s] floats): FSDP2 hooks a wrapped module's output for its
        # backward, which an in-place op on a view would drop (it warns about any view)
        return loss.t().clone()

    def _dropout_masks(self, sample_ids: torch.Tensor | None) -> LogicalDropout | None:
        config = self.config
        if sample_ids is None or not self.training:
            return None
        if config.attention_dropout == 0 and config.hidden_dropout == 0:
            return None
        return LogicalDropout(
            self.seed,
            sample_ids,
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            sequence_parallel=self.sequence_parallel,
            cp_rank=self.cp.rank,
            cp_size=self.cp.size,
        )

    def _mark_embedding_and_output(self) -> None:
        """Megatron's `is_embedding_or_output_parameter` (the parameters --decoupled-lr
        drives): the word embedding and the output layer's weight, a tied copy included."""
        marked = [self.embedding.word_embeddings.weight] if self.embedding is not None else []
        if self.output_layer is not None:
            marked.append(self.output_layer.weight)
        for param in marked:
            param.meta = dataclasses.replace(param.meta, embedding_or_output=True)

    def shared_word_embedding(self) -> torch.nn.Parameter | None:
        """The tied word-embedding weight this stage holds, if any (for the embedding group)."""
        if self.config.untie_embeddings_and_output_weights:
            return None
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.output_layer is not None else None
