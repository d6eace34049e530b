"""Checkpoints laid out as Megatron-LM's `save_checkpoint` writes them, made by Megatron-Core
0.16.1 itself on forked gloo ranks (the `megatron-core` wheel has no `megatron.training`, so the
few lines of `save_checkpoint` that assemble the state dict are restated here):

- torch_dist: `dist_checkpointing.save({"args": Namespace, "checkpoint_version": 3.0,
  "iteration": N, "model": model.sharded_state_dict(), "opt_param_scheduler": {...},
  "num_floating_point_operations_so_far": ...}, SAVE/iter_000000N)`;
- legacy torch: `torch.save({... "model": model.state_dict_for_save_checkpoint(), "rng_state":
  [...]}, SAVE/release/mp_rank_TT_PPP/model_optim_rng.pt)` on every TP x PP rank, the model
  resharded from the torch_dist checkpoint by Megatron-Core's own `dist_checkpointing.load`.

`args` carries what Megatron-LM's would for this model (typed values, `params_dtype` a torch
dtype, `attention_backend` Megatron-Core's AttnBackend enum). The reference a test compares
with: Megatron-Core's logits and its greedy continuation over the real vocabulary. The output
layer's padding rows are set large, so a generator that samples padding ids is caught.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

LAYERS, HIDDEN, HEADS, SEQ = 2, 32, 4, 32
NULL_VOCAB = 99  # --vocab-size of Megatron's NullTokenizer: ids 0..98 and the eod 99
REAL_VOCAB = NULL_VOCAB + 1
DIVISIBLE_BY = 64  # padded to 128 rows at TP1 (multiple 64) and at TP2 (multiple 128)
PADDED_VOCAB = 128
PROMPT = [5, 17, 42, 8, 63]
NEW_TOKENS = 8
ITERATION, GLOBAL_BATCH = 5, 4


def patch_cuda_calls() -> None:
    """Megatron-Core's hard-coded CUDA calls, made CPU no-ops (in a forked rank only)."""
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the tied copy's first all-reduce
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def model_args(kind: str, tp: int, pp: int) -> argparse.Namespace:
    """What Megatron-LM's `args` holds for the fixture model (the entries readers use)."""
    from megatron.core.transformer.enums import AttnBackend

    rope = kind == "llama"
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN if not rope else 64,
        num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS, group_query_attention=rope,
        num_query_groups=2 if rope else 1, seq_length=SEQ, max_position_embeddings=SEQ,
        position_embedding_type="rope" if rope else "learned_absolute", rotary_percent=1.0,
        rotary_base=10000, normalization="RMSNorm" if rope else "LayerNorm", norm_epsilon=1e-5,
        swiglu=rope, squared_relu=False, openai_gelu=False, qk_layernorm=False,
        apply_residual_connection_post_layernorm=False, add_bias_linear=not rope,
        add_qkv_bias=False, untie_embeddings_and_output_weights=rope,
        make_vocab_size_divisible_by=DIVISIBLE_BY, padded_vocab_size=PADDED_VOCAB,
        vocab_size=NULL_VOCAB, tokenizer_type="NullTokenizer", init_method_std=0.02,
        attention_dropout=0.0, hidden_dropout=0.0, num_experts=None,
        multi_latent_attention=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None, world_size=tp * pp, data_parallel_size=1,
        micro_batch_size=1, global_batch_size=GLOBAL_BATCH, train_iters=20, lr=1e-3,
        min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=None,
        weight_decay=0.01, clip_grad=1.0, fp16=False, bf16=False, params_dtype=torch.float32,
        seed=1234, consumed_train_samples=ITERATION * GLOBAL_BATCH, consumed_valid_samples=0,
        ckpt_format="torch_dist", attention_backend=AttnBackend.auto,
    )  # fmt: skip


def scheduler_state(args: argparse.Namespace) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() after ITERATION steps (in samples)."""
    gbs = args.global_batch_size
    return {
        "max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * gbs,
        "num_steps": ITERATION * gbs, "lr_decay_style": args.lr_decay_style,
        "lr_decay_steps": args.train_iters * gbs, "min_lr": args.min_lr,
        "start_wd": args.weight_decay, "end_wd": args.weight_decay,
        "wd_incr_style": "constant", "wd_incr_steps": args.train_iters * gbs,
    }  # fmt: skip


def build_model(kind: str, tp: int = 1, pp: int = 1, pre: bool = True, post: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = kind == "llama"
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=2 if llama else None, ffn_hidden_size=64 if llama else 4 * HIDDEN,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama, activation_func=torch.nn.functional.silu if llama else
        torch.nn.functional.gelu, add_bias_linear=not llama, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
    )  # fmt: skip
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=PADDED_VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=not llama,
        position_embedding_type="rope" if llama else "learned_absolute",
    ).eval()


def logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), padded vocab] of a whole (1-stage) Megatron-Core model."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    causal = torch.triu(torch.ones(len(tokens), len(tokens), dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(ids, positions, causal)[0]


def greedy(model, prompt: list[int], new: int) -> list[int]:
    """Megatron-Core's greedy continuation over the real vocabulary (no KV cache)."""
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(logits(model, tokens)[-1, :REAL_VOCAB].argmax()))
    return tokens[len(prompt) :]


def write_tracker(save: str, text: str) -> None:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(text)


def write_torch_dist(rank: int, world_size: int, kind: str, save: str) -> dict:
    """One rank: a Megatron-Core model at TP1, saved as Megatron-LM saves torch_dist; its
    reference logits and greedy tokens."""
    from megatron.core import dist_checkpointing, parallel_state

    patch_cuda_calls()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(7)
    model = build_model(kind)
    with torch.no_grad():  # padding rows that would win every argmax
        weight = (
            model.output_layer.weight
            if kind == "llama"
            else model.shared_embedding_or_output_weight()
        )
        weight[REAL_VOCAB:] = 5.0 * weight[:REAL_VOCAB].abs().max()
    args = model_args(kind, 1, 1)
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
        "model": model.sharded_state_dict(), "opt_param_scheduler": scheduler_state(args),
        "num_floating_point_operations_so_far": 1.0e9,
    }  # fmt: skip
    directory = os.path.join(save, f"iter_{ITERATION:07d}")
    os.makedirs(directory)
    dist_checkpointing.save(state, directory)
    write_tracker(save, str(ITERATION))
    return {
        "logits": logits(model, PROMPT)[:, :REAL_VOCAB].clone(),
        "tokens": greedy(model, PROMPT, NEW_TOKENS),
        "padding_wins": int(logits(model, PROMPT)[-1].argmax()) >= REAL_VOCAB,
    }


def write_legacy(rank: int, world_size: int, kind: str, source: str, save: str, tp: int) -> None:
    """Every rank of TP x PP: Megatron-Core reshards `source` (torch_dist) into its own model,
    and the rank writes its `release/mp_rank_*/model_optim_rng.pt` as Megatron-LM does."""
    from megatron.core import dist_checkpointing, parallel_state

    patch_cuda_calls()
    pp = world_size // tp
    parallel_state.initialize_model_parallel(tp, pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model = build_model(kind, tp, pp, pre=pp_rank == 0, post=pp_rank == pp - 1)
    directory = os.path.join(source, f"iter_{ITERATION:07d}")
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, directory, validate_access_integrity=False
    )
    model.load_state_dict(loaded["model"])
    args = model_args(kind, tp, pp)
    args.ckpt_format = "torch"
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    folder = os.path.join(save, "release", name)
    os.makedirs(folder, exist_ok=True)
    torch.save(
        {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 0,
            "model": model.state_dict_for_save_checkpoint(),
            "rng_state": [{"random_rng_state": None, "torch_rng_state": torch.get_rng_state()}],
            "num_floating_point_operations_so_far": 0,
        },  # fmt: skip
        os.path.join(folder, "model_optim_rng.pt"),
    )
    if rank == 0:
        write_tracker(save, "release")
