"""Megatron-LM command-line flags -> validated configs. The only module that knows flag names.

`parse_args` never exits (except for `-h`): every problem, from an unknown flag to heads that do
not split over TP, is a `ConfigError` whose one-line message names the flags and their values,
so `pretrain_gpt.py` can print it identically on every rank before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections.abc import Sequence
from typing import NoReturn

import torch

from megapipe.config import (
    ConfigError,
    Configs,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    validate_configs,
)
from megapipe.parallel.initialize import default_backend

PROG = "pretrain_gpt.py"
NO_DATASET = "no dataset: pass --mock-data, --data-path or --train-data-path"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The parser, with Megatron-LM's flag names, defaults and help texts."""
    parser = _Parser(
        prog=PROG,
        description="Pre-train a GPT model with tensor, pipeline and data parallelism "
        "(Megatron-LM flags). Launch with `torchrun --nproc_per_node N pretrain_gpt.py ...` "
        "or, for one rank, `python pretrain_gpt.py ...`.",
        allow_abbrev=False,
    )
    _add_network_args(parser.add_argument_group("network size"))
    _add_regularization_args(parser.add_argument_group("regularization"))
    _add_distributed_args(parser.add_argument_group("distributed"))
    _add_training_args(parser.add_argument_group("training"))
    _add_optimizer_args(parser.add_argument_group("optimizer and mixed precision"))
    _add_data_args(parser.add_argument_group("data"))
    return parser


def _add_network_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--num-layers", type=int, required=True, help="Number of transformer layers."
    )
    group.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Transformer feed-forward network hidden size. Default: 4 x hidden size, or "
        "int(8 x hidden size / 3 / 64) x 64 with --swiglu (as Megatron-LM).",
    )
    group.add_argument(
        "--num-attention-heads", type=int, required=True, help="Number of attention heads."
    )
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (keys and values shared by --num-query-groups groups).",
    )
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Number of query groups; only takes effect with --group-query-attention. "
        "Default with it: 1 (multi-query attention), as Megatron-LM.",
    )
    group.add_argument(
        "--seq-length", type=int, required=True, help="Maximum sequence length to process."
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Maximum number of position embeddings. Default: --seq-length.",
    )
    group.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        help="Position embedding type: learned_absolute, rope or none. Default: learned_absolute.",
    )
    group.add_argument(
        "--rotary-base", type=int, default=10000, help="Base of rotary embeddings. Default: 10000."
    )
    group.add_argument(
        "--normalization",
        default="LayerNorm",
        help="Normalization layer: LayerNorm or RMSNorm. Default: LayerNorm.",
    )
    group.add_argument(
        "--layernorm-epsilon", type=float, default=1e-5, help="Norm epsilon. Default: 1e-5."
    )
    group.add_argument(
        "--swiglu", action="store_true", help="Use gated linear units and SiLU activation (SwiGLU)."
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Untie the input word embedding and the output layer weights.",
    )
    group.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="Disable bias in the linear layers.",
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocab size to be divisible by this value (times the tensor-model-parallel "
        "size), for computation efficiency. Default: 128.",
    )
    group.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Standard deviation of the zero-mean normal weight initialisation. Default: 0.02.",
    )


def _add_regularization_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="Post attention dropout probability. Default: 0.1.",
    )
    group.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="Dropout probability for hidden state transformer. Default: 0.1.",
    )


def _add_distributed_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Degree of tensor model parallelism. Default: 1.",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Degree of pipeline model parallelism. Default: 1.",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual pipeline stage (model chunk); turns on the interleaved "
        "schedule with --num-layers / (PP x this) chunks per pipeline rank.",
    )
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (the interleaved schedule); an alternative to "
        "--num-layers-per-virtual-pipeline-stage.",
    )
    group.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Transformer layers on the first pipeline stage (the rest split evenly).",
    )
    group.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Transformer layers on the last pipeline stage (the rest split evenly).",
    )
    group.add_argument(
        "--pipeline-schedule",
        default=None,
        help="1f1b, gpipe or interleaved-1f1b. Default: 1f1b, or interleaved-1f1b with "
        "virtual stages.",
    )
    group.add_argument(
        "--pipeline-partition",
        default="uniform",
        help="How layers are split over stages: uniform (Megatron-LM's rule) or balanced "
        "(equal FLOPs per stage counting the output layer on the last stage). Default: uniform.",
    )
    group.add_argument(
        "--pipeline-p2p-timeout",
        type=float,
        default=300.0,
        help="Seconds a pipeline stage waits for a neighbour before failing with an error that "
        "names it. Default: 300.",
    )
    group.add_argument(
        "--pipeline-trace",
        default=None,
        metavar="PATH",
        help="Write the measured start and end of every pipeline action on every rank (first "
        "10 iterations) as Chrome-trace JSON to PATH (open in Perfetto or chrome://tracing).",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Enable sequence parallelism (needs --tensor-model-parallel-size > 1).",
    )
    group.add_argument(
        "--distributed-backend",
        default=None,
        help="Which backend to use for distributed training: nccl or gloo. "
        "Default: nccl when CUDA is available, else gloo.",
    )


def _add_training_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--micro-batch-size",
        type=int,
        required=True,
        help="Batch size per model instance (local batch size). Global batch size is local "
        "batch size times data-parallel size times number of micro batches.",
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Training batch size. Default: --micro-batch-size x data-parallel size; a larger "
        "value means gradient accumulation over micro-batches.",
    )
    group.add_argument(
        "--train-iters", type=int, required=True, help="Total number of iterations to train."
    )
    group.add_argument(
        "--lr", type=float, required=True, help="Learning rate (constant for now; Adam)."
    )
    group.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Random seed for python, numpy, torch. Default: 1234.",
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="Report loss and timing interval. Default: 100.",
    )


def _add_optimizer_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--optimizer",
        default="adam",
        help="adam (AdamW, decoupled weight decay, as Megatron-LM) or sgd. Default: adam.",
    )
    add("--adam-beta1", type=float, default=0.9, help="Adam beta1. Default: 0.9.")
    add("--adam-beta2", type=float, default=0.999, help="Adam beta2. Default: 0.999.")
    add("--adam-eps", type=float, default=1e-8, help="Adam epsilon. Default: 1e-8.")
    add("--sgd-momentum", type=float, default=0.9, help="SGD momentum. Default: 0.9.")
    add(
        "--weight-decay",
        type=float,
        default=0.01,
        help="Weight decay (not applied to biases and norm weights). Default: 0.01.",
    )
    add(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip the global gradient norm (whole "
        "model, all ranks) to this value; 0 disables. Default: 1.0.",
    )
    add(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard fp32 master weights and optimizer state over data-parallel ranks (ZeRO-1).",
    )
    add(
        "--overlap-grad-reduce",
        action="store_true",
        help="Reduce each gradient bucket over "
        "data-parallel ranks asynchronously as soon as it is ready during backward.",
    )
    add(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Elements per gradient bucket. Default: 40,000,000.",
    )
    add(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accepted for "
        "Megatron-LM compatibility: gradients are always accumulated and reduced in fp32.",
    )
    add(
        "--bf16",
        action="store_true",
        help="bf16 parameters and activations, fp32 master weights and gradients.",
    )
    add(
        "--fp16",
        action="store_true",
        help="fp16 parameters and activations with loss scaling, "
        "fp32 master weights and gradients.",
    )
    add(
        "--loss-scale",
        type=float,
        default=None,
        help="Static fp16 loss scale (a power of 2); default: dynamic loss scaling.",
    )
    add(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="Initial dynamic loss scale. Default: 2^32.",
    )
    add("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale. Default: 1.")
    add(
        "--loss-scale-window",
        type=int,
        default=1000,
        help="Clean iterations before the dynamic loss scale doubles. Default: 1000.",
    )
    add(
        "--hysteresis",
        type=int,
        default=2,
        help="Overflows tolerated before the dynamic loss scale backs off. Default: 2.",
    )
    add(
        "--min-lr",
        type=float,
        default=0.0,
        help="Minimum learning rate the decay reaches. Default: 0.",
    )
    add(
        "--lr-decay-style",
        default="linear",
        help="constant, linear, cosine, inverse-square-root or WSD. Default: linear.",
    )
    add(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay over. Default: --train-iters.",
    )
    add("--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup. Default: 0.")
    add(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    add(
        "--lr-warmup-init",
        type=float,
        default=0.0,
        help="Learning rate at the start of warmup. Default: 0.",
    )
    add(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: iterations of the final decay phase.",
    )
    add(
        "--lr-wsd-decay-style",
        default="exponential",
        help="WSD decay: exponential, linear, cosine or minus_sqrt. Default: exponential.",
    )


def _add_data_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--mock-data",
        action="store_true",
        help="Train on synthetic data (needs --vocab-size or --tokenizer-type).",
    )
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefix(es) (PREFIX.bin/.idx), optionally weighted: `0.3 A 0.7 B` blends A "
        "and B by weight. Split into train/valid/test by --split.",
    )
    group.add_argument(
        "--split",
        default="969, 30, 1",
        help="Train/valid/test proportions of each --data-path dataset, e.g. 969,30,1 "
        "(normalised). Default: 969, 30, 1.",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"Dataset prefix(es), optionally weighted, used whole for the {split} split "
            "(instead of --data-path and --split).",
        )
    group.add_argument(
        "--data-cache-path",
        default=None,
        help="Directory for the cached dataset indices (.npy), built once by global rank 0. "
        "Default: build in memory on every rank.",
    )
    group.add_argument(
        "--tokenizer-type",
        default=None,
        help="SentencePieceTokenizer, GPTSentencePieceTokenizer, GPT2BPETokenizer, "
        "HuggingFaceTokenizer or NullTokenizer. Its vocabulary size becomes the model's.",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece model file, or a Hugging Face tokenizer.json or directory.",
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json.")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt.")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Size of the vocabulary: with --mock-data and no tokenizer, or for NullTokenizer.",
    )
    group.add_argument(
        "--eod-mask-loss", action="store_true", help="Mask the loss where the input is the eod."
    )
    group.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="Restart position ids after each end-of-document token.",
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="Attend only within a document (not supported yet; rejected).",
    )


def _data_config(args: argparse.Namespace) -> tuple[DataConfig, int, list[str]]:
    """The data flags as a DataConfig, checked against the files they name; also returns the
    vocabulary size (the tokenizer's, else --vocab-size) and notes for the user."""
    from megapipe.data.config_check import check_data_config
    from megapipe.data.errors import DataError

    data = DataConfig(
        mock_data=args.mock_data,
        data_path=tuple(args.data_path or ()),
        split=args.split,
        train_data_path=tuple(args.train_data_path or ()),
        valid_data_path=tuple(args.valid_data_path or ()),
        test_data_path=tuple(args.test_data_path or ()),
        data_cache_path=args.data_cache_path,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
    )
    if not (data.mock_data or data.real_data):
        raise ConfigError(NO_DATASET)
    data.validate()
    if data.reset_attention_mask:
        raise ConfigError(
            "--reset-attention-mask is not supported yet: attention takes no per-document mask "
            "(--reset-position-ids and --eod-mask-loss are)"
        )
    try:
        check = check_data_config(data)
    except DataError as error:
        raise ConfigError(str(error)) from None
    if check.vocab_size is None:
        raise ConfigError(
            "--mock-data needs --vocab-size (or --tokenizer-type, whose vocabulary size is used)"
        )
    return data, check.vocab_size, list(check.notes)


def _virtual_stages(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank, from either of Megatron's two spellings."""
    per_stage, per_rank = (
        args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank,
    )
    if per_stage is not None and per_rank is not None:
        raise ConfigError(
            "pass one of --num-layers-per-virtual-pipeline-stage and "
            "--num-virtual-stages-per-pipeline-rank, not both"
        )
    if per_rank is not None:
        if per_rank < 1:
            raise ConfigError(
                f"--num-virtual-stages-per-pipeline-rank must be positive, got {per_rank}"
            )
        return per_rank
    if per_stage is None:
        return 1
    pp = args.pipeline_model_parallel_size
    if per_stage < 1 or pp < 1 or args.num_layers % (pp * per_stage):
        raise ConfigError(
            f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({pp}) x --num-layers-per-virtual-pipeline-stage ({per_stage})"
        )
    return args.num_layers // (pp * per_stage)


def parse_args(argv: Sequence[str] | None, world_size: int) -> Configs:
    """Parse Megatron-LM flags (`sys.argv[1:]` when `argv` is None) and validate them.

    Raises ConfigError naming the offending flags and values; warns (UserWarning) for settings
    Megatron-LM accepts but ignores. The warnings are also kept in `Configs.warnings`.
    """
    args = build_parser().parse_args(argv)
    notes: list[str] = []

    data, vocab_size, data_notes = _data_config(args)
    notes += data_notes

    num_query_groups = None
    if args.group_query_attention:
        num_query_groups = 1 if args.num_query_groups is None else args.num_query_groups
    elif args.num_query_groups is not None:
        notes.append(
            f"--num-query-groups ({args.num_query_groups}) has no effect without "
            "--group-query-attention; using multi-head attention"
        )

    backend = args.distributed_backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "--distributed-backend nccl needs CUDA, which is not available here; use gloo"
        )

    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=num_query_groups,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        swiglu=args.swiglu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_virtual_stages(args),
        pipeline_schedule=args.pipeline_schedule,
        pipeline_partition=args.pipeline_partition,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_p2p_timeout=args.pipeline_p2p_timeout,
        pipeline_trace=args.pipeline_trace,
        sequence_parallel=args.sequence_parallel,
        distributed_backend=backend,
    )
    parallel.validate(world_size)  # before the DP size below is computed from it
    global_batch_size = args.global_batch_size
    if global_batch_size is None:  # Megatron: one micro-batch per DP rank, no accumulation
        global_batch_size = args.micro_batch_size * parallel.data_parallel_size(world_size)
    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=global_batch_size,
        train_iters=args.train_iters,
        lr=args.lr,
        seed=args.seed,
        log_interval=args.log_interval,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_init=args.lr_warmup_init,
        lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        mock_data=args.mock_data,
    )
    optimizer = OptimizerConfig(
        optimizer=args.optimizer,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        ddp_bucket_size=args.ddp_bucket_size,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    configs = validate_configs(model, parallel, training, world_size, optimizer)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return dataclasses.replace(configs, warnings=tuple(notes) + configs.warnings, data=data)
