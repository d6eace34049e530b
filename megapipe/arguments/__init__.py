"""Megatron-LM command-line flags -> validated configs. The only package that knows flag names.

`parse_args` never exits (except for `-h`): every problem, from an unknown flag to heads that do
not split over TP, is a `ConfigError` whose one-line message names the flags and their values,
so `pretrain_gpt.py` can print it identically on every rank before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn, TypeVar

import torch

from megapipe.arguments.checkpoint_args import checkpoint_flags
from megapipe.arguments.data_flags import NO_DATASET, add_data_args, data_config
from megapipe.arguments.kernel_flags import add_kernel_args, kernel_config
from megapipe.arguments.logging_flags import (
    add_checkpoint_args,
    add_logging_args,
    add_validation_args,
)
from megapipe.arguments.megatron_compat import (
    add_compat_args,
    compat_notes,
    refuse_unsupported,
    unknown_flag_message,
)
from megapipe.arguments.model_flags import (
    add_network_args,
    add_regularization_args,
    resolve_position_embedding,
)
from megapipe.arguments.moe_flags import add_moe_args, moe_config, validate_moe_features
from megapipe.arguments.parallel_flags import (
    add_distributed_args,
    cp_comm_type,
    nccl_emulation_rules,
    virtual_stages,
)
from megapipe.arguments.recompute_flags import add_recompute_args, recompute_config
from megapipe.arguments.sharding_flags import add_sharding_args, resolve_sharding
from megapipe.arguments.training_flags import add_optimizer_args, add_training_args
from megapipe.arguments.validation import validate_configs, validate_parallel
from megapipe.checkpointing.tracker import checkpoint_to_load
from megapipe.config import (
    CheckpointConfig,
    Configs,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from megapipe.errors import ConfigError
from megapipe.parallel.initialize import default_backend
from megapipe.training.batch_size import BatchSizeSchedule

PROG = "pretrain_gpt.py"
T = TypeVar("T")
__all__ = ["NO_DATASET", "PROG", "build_parser", "parse_args"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(unknown_flag_message(message, self))


def build_parser() -> argparse.ArgumentParser:
    """The parser, with Megatron-LM's flag names, defaults and help texts."""
    parser = _Parser(
        prog=PROG,
        description="Pre-train a GPT model with tensor, pipeline and data parallelism "
        "(Megatron-LM flags). Launch with `torchrun --nproc_per_node N pretrain_gpt.py ...` "
        "or, for one rank, `python pretrain_gpt.py ...`.",
        allow_abbrev=False,
    )
    add_network_args(parser.add_argument_group("network size"))
    add_regularization_args(parser.add_argument_group("regularization"))
    add_moe_args(parser.add_argument_group("mixture of experts"))
    add_distributed_args(parser.add_argument_group("distributed"))
    add_training_args(parser.add_argument_group("training"))
    add_optimizer_args(parser.add_argument_group("optimizer and mixed precision"))
    add_sharding_args(parser.add_argument_group("sharded data parallelism (ZeRO)"))
    add_data_args(parser.add_argument_group("data"))
    add_validation_args(parser.add_argument_group("validation"))
    add_logging_args(parser.add_argument_group("logging"))
    add_checkpoint_args(parser.add_argument_group("checkpointing"))
    add_recompute_args(parser.add_argument_group("activation recomputation"))
    add_kernel_args(parser.add_argument_group("kernels and attention"))
    add_compat_args(parser.add_argument_group("Megatron-LM compatibility"))
    return parser


def parse_args(argv: Sequence[str] | None, world_size: int) -> Configs:
    """Parse Megatron-LM flags (`sys.argv[1:]` when `argv` is None) and validate them.

    Raises ConfigError naming the offending flags and values; warns (UserWarning) for settings
    Megatron-LM accepts but ignores. The warnings are also kept in `Configs.warnings`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    refuse_unsupported(argv)
    parser = build_parser()
    argv += checkpoint_flags(argv, set(parser._option_string_actions))  # --use-checkpoint-args
    args = parser.parse_args(argv)
    notes: list[str] = compat_notes(args)

    resolve_position_embedding(args)
    data, vocab_size, data_notes = data_config(args)
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
    if args.emulate_nccl_p2p_order is not None and backend != "gloo":
        raise ConfigError(
            f"--emulate-nccl-p2p-order emulates NCCL's ordering on gloo; this run's backend is "
            f"{backend}, which needs no emulation (drop the flag, or --distributed-backend gloo)"
        )
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
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        swiglu=args.swiglu,
        openai_gelu=args.openai_gelu,
        squared_relu=args.squared_relu,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        moe=moe_config(args),
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        cp_comm_type=cp_comm_type(args),
        virtual_pipeline_model_parallel_size=virtual_stages(args),
        pipeline_schedule=args.pipeline_schedule,
        pipeline_partition=args.pipeline_partition,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_p2p_timeout=args.pipeline_p2p_timeout,
        pipeline_receives_ahead=args.overlap_p2p_communication,
        emulate_nccl_p2p_order=nccl_emulation_rules(args.emulate_nccl_p2p_order),
        pipeline_trace=args.pipeline_trace,
        sequence_parallel=args.sequence_parallel,
        tp_comm_overlap=args.tp_comm_overlap,
        distributed_backend=backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        watchdog_timeout_factor=args.watchdog_timeout_factor,
        watchdog_min_seconds=args.watchdog_min_seconds,
        watchdog_max_seconds=args.watchdog_max_seconds,
    )
    validate_parallel(parallel, world_size)  # before the DP size below is computed from it
    training = _training_config(args, parallel.data_parallel_size(world_size))
    resolve_sharding(args)
    optimizer = _from_args(OptimizerConfig, args)
    logging = _from_args(LoggingConfig, args)
    logging = dataclasses.replace(logging, profile_ranks=tuple(args.profile_ranks))
    checkpoint = _from_args(CheckpointConfig, args)
    notes += checkpoint_notes(checkpoint)
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        notes.append("--decoupled-min-lr has no effect without --decoupled-lr")
    recompute = recompute_config(args)
    kernels = kernel_config(args)
    validate_moe_features(
        model.moe, parallel, recompute, kernels, checkpoint, optimizer, world_size
    )
    configs = validate_configs(
        model,
        parallel,
        training,
        world_size,
        optimizer,
        data=data,
        logging=logging,
        checkpoint=checkpoint,
        recompute=recompute,
        kernels=kernels,
        arguments=tuple(
            (name, repr(_recorded(name, value))) for name, value in sorted(vars(args).items())
        ),
    )
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return dataclasses.replace(configs, warnings=tuple(notes) + configs.warnings)


# Files a checkpoint's readers open again (tools/generate_text.py, the Hugging Face export):
# recorded as absolute paths, so that they work from any directory, not only the launch one.
RECORDED_AS_ABSOLUTE = ("tokenizer_model", "vocab_file", "merge_file")


def _recorded(name: str, value: object) -> object:
    """A flag's value as the run records it (checkpoint `args`, TensorBoard): an existing file
    a reader reopens becomes absolute (a Hugging Face hub name that is no path stays as it is)."""
    if name in RECORDED_AS_ABSOLUTE and isinstance(value, str) and os.path.exists(value):
        return os.path.abspath(value)
    return value


def _from_args(cls: type[T], args: argparse.Namespace) -> T:
    """A config whose every field is the flag of the same name (`adam_beta1` <- --adam-beta1)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _training_config(args: argparse.Namespace, data_parallel_size: int) -> TrainingConfig:
    """The loop's settings; --train-samples and the sample-based LR flags become iterations."""
    global_batch_size = args.global_batch_size
    if global_batch_size is None:  # Megatron: one micro-batch per DP rank, no accumulation
        global_batch_size = args.micro_batch_size * data_parallel_size
    if (args.train_iters is None) == (args.train_samples is None):
        raise ConfigError("pass exactly one of --train-iters and --train-samples")
    lengths = {
        "lr_decay_iters": args.lr_decay_iters,
        "lr_warmup_iters": args.lr_warmup_iters,
        "lr_wsd_decay_iters": args.lr_wsd_decay_iters,
    }
    train_iters = args.train_iters
    if args.train_samples is not None:
        for name in ("--lr-decay-iters", "--lr-warmup-iters", "--lr-wsd-decay-iters"):
            value = getattr(args, name[2:].replace("-", "_"))
            if value:
                samples = name.replace("-iters", "-samples")
                raise ConfigError(f"{name} needs --train-iters; with --train-samples use {samples}")
        schedule = BatchSizeSchedule(
            global_batch_size, args.micro_batch_size, data_parallel_size, args.rampup_batch_size
        )
        if args.micro_batch_size > 0 and global_batch_size > 0:
            schedule.validate()
        train_iters = schedule.iterations_for_samples(args.train_samples)
        per_iteration = float(global_batch_size)  # Megatron's scheduler counts full batches
        for name, samples in (
            ("lr_decay_iters", args.lr_decay_samples),
            ("lr_warmup_iters", args.lr_warmup_samples),
            ("lr_wsd_decay_iters", args.lr_wsd_decay_samples),
        ):
            if samples:
                lengths[name] = samples / per_iteration
    else:
        for name in ("--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples"):
            if getattr(args, name[2:].replace("-", "_")):
                iters = name.replace("-samples", "-iters")
                raise ConfigError(f"{name} needs --train-samples; with --train-iters use {iters}")
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=global_batch_size,
        train_iters=train_iters,
        train_samples=args.train_samples,
        rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        lr=args.lr,
        seed=args.seed,
        log_interval=args.log_interval,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_init=args.lr_warmup_init,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        skip_train=args.skip_train,
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        exit_signal=args.exit_signal,
        exit_signal_handler_for_dataloader=args.exit_signal_handler_for_dataloader,
        **lengths,
    )


def checkpoint_notes(checkpoint: CheckpointConfig) -> list[str]:
    """Check the checkpoint flags against the directories they name; notes for the user.

    A --load directory without a checkpoint starts from scratch (as in Megatron) unless
    --exit-on-missing-checkpoint; a named iteration that does not exist is an error."""
    if checkpoint.ckpt_format == "fsdp_dtensor":
        raise ConfigError(
            "--ckpt-format fsdp_dtensor (Megatron-FSDP's own format) is not supported: "
            "torch_dist holds every sharding strategy's state and loads under any other"
        )
    if checkpoint.ckpt_format not in ("torch_dist", "torch"):
        raise ConfigError(
            f"--ckpt-format {checkpoint.ckpt_format!r}: choose torch_dist (layout-free, "
            "loadable at any TP/PP/DP) or torch (Megatron's legacy per-rank layout)"
        )
    if checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
            "each other: the command line's schedule or the checkpoint's, pass one of them"
        )
    if checkpoint.save_interval is not None and checkpoint.save_interval <= 0:
        raise ConfigError(f"--save-interval must be positive, got {checkpoint.save_interval}")
    notes = []
    if checkpoint.save_interval is not None and checkpoint.save is None:
        notes.append("--save-interval has no effect without --save")
    if checkpoint.load is not None and checkpoint_to_load(checkpoint) is None:
        notes.append(
            f"--load {checkpoint.load}: no checkpoint found (no "
            "latest_checkpointed_iteration.txt); training starts from scratch"
        )
    return notes
