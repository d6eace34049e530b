"""Up-front validation of the settled configs: every flag combination, on every rank alike,
before any process group or model exists.

A bad combination raises ConfigError with one line naming the flags and their values (heads
not divisible by TP, layers that do not split over PP x VP, a world size that is not a multiple
of TP x PP, a global batch that is not a whole number of micro-batches per rank, a ramp-up or
schedule that cannot run). Lives on the flag side so that `megapipe.config` stays pure data and
may be imported by the layers that this module consults (schedules, partition, LR schedule).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from megapipe.arguments.logging_flags import validate_monitoring
from megapipe.arguments.sharding_flags import hybrid_groups
from megapipe.config import (
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    Configs,
    DataConfig,
    KernelConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainingConfig,
)
from megapipe.errors import ConfigError, flag
from megapipe.pipeline.partition import StageMap
from megapipe.pipeline.schedules import validate_schedule
from megapipe.pipeline.stage_memory import plan_stages
from megapipe.training.batch_size import batch_size_schedule_of
from megapipe.training.lr_schedule import decoupled_schedule_of, lr_schedule_of


def _require(condition: object, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(**values: int | float) -> None:
    for name, value in values.items():
        _require(value > 0, f"{flag(name)} must be positive, got {value}")


def _divisible(numerator: tuple[str, int], denominator: tuple[str, int]) -> None:
    (n_name, n), (d_name, d) = numerator, denominator
    _require(n % d == 0, f"{n_name} ({n}) must be divisible by {d_name} ({d})")


# Far beyond any trained model; the per-layer plans (stage maps, recompute lists) stay cheap.
MAX_NUM_LAYERS = 100_000


def validate_model(model: ModelConfig) -> None:
    _require(
        model.num_layers <= MAX_NUM_LAYERS,
        f"--num-layers ({model.num_layers}) exceeds {MAX_NUM_LAYERS:,}, far beyond any model "
        "that trains",
    )
    _positive(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        vocab_size=model.vocab_size,
        seq_length=model.seq_length,
        ffn_hidden_size=model.ffn_hidden_size,
        num_query_groups=model.num_query_groups,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        init_method_std=model.init_method_std,
    )
    if model.kv_channels is None:  # the head dim is hidden / heads
        _divisible(
            ("--hidden-size", model.hidden_size),
            ("--num-attention-heads", model.num_attention_heads),
        )
    else:
        _positive(kv_channels=model.kv_channels)
    _divisible(
        ("--num-attention-heads", model.num_attention_heads),
        ("--num-query-groups", model.num_query_groups),
    )
    _require(
        model.position_embedding_type in POSITION_EMBEDDING_TYPES,
        f"--position-embedding-type {model.position_embedding_type!r} is not one of "
        f"{', '.join(POSITION_EMBEDDING_TYPES)}",
    )
    _require(
        model.normalization in NORMALIZATIONS,
        f"--normalization {model.normalization!r} is not one of {', '.join(NORMALIZATIONS)}",
    )
    if model.position_embedding_type == "learned_absolute":
        _require(
            model.seq_length <= model.max_position_embeddings,
            f"--seq-length ({model.seq_length}) exceeds --max-position-embeddings "
            f"({model.max_position_embeddings}) with learned absolute position embeddings",
        )
    _require(
        0.0 < model.rotary_percent <= 1.0,
        f"--rotary-percent must be in (0, 1], got {model.rotary_percent}",
    )
    if model.position_embedding_type == "rope":
        head = (
            "--kv-channels"
            if model.kv_channels is not None
            else "--hidden-size/--num-attention-heads"
        )
        if model.rotary_percent == 1.0:
            _require(
                model.head_dim % 2 == 0,
                f"rotary embeddings need an even head dim, got {head} = {model.head_dim}",
            )
        else:
            _require(
                model.rotary_dim > 0 and model.rotary_dim % 2 == 0,
                f"rotary embeddings need an even, positive number of rotated dims, got "
                f"int({head} {model.head_dim} x --rotary-percent {model.rotary_percent}) = "
                f"{model.rotary_dim}",
            )
    else:
        _require(
            model.rotary_percent == 1.0,
            f"--rotary-percent {model.rotary_percent} needs rotary embeddings "
            f"(--position-embedding-type rope), got {model.position_embedding_type}",
        )
    _require(
        not (model.openai_gelu and model.swiglu),
        "--openai-gelu with --swiglu: the SwiGLU MLP has no GeLU (it uses SiLU)",
    )
    _require(
        not (model.squared_relu and model.swiglu),
        "--squared-relu with --swiglu: the MLP has one activation (squared ReLU or SwiGLU)",
    )
    _require(
        not (model.squared_relu and model.openai_gelu),
        "--squared-relu with --openai-gelu: the MLP has one activation (squared ReLU or GeLU)",
    )
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(model, name)
        _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")


def validate_parallel(parallel: ParallelConfig, world_size: int) -> None:
    _positive(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
    )
    if parallel.watchdog_max_seconds is not None:  # 0 would end the first step at once
        _positive(watchdog_max_seconds=parallel.watchdog_max_seconds)
    cp = parallel.context_parallel_size
    model_parallel = parallel.model_parallel_size * cp  # the ranks of one data-parallel replica
    _require(
        world_size % model_parallel == 0,
        f"world size ({world_size}) is not divisible by --tensor-model-parallel-size "
        f"({parallel.tensor_model_parallel_size})"
        + (f" x --context-parallel-size ({cp})" if cp > 1 else "")
        + f" x --pipeline-model-parallel-size ({parallel.pipeline_model_parallel_size}) = "
        f"{model_parallel}",
    )
    _require(
        parallel.distributed_backend in (None, "gloo", "nccl"),
        f"--distributed-backend {parallel.distributed_backend!r} is not one of gloo, nccl",
    )


def validate_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The sequence splits into 2 x CP chunks (Megatron's load balancing), and a2a splits the
    heads and query groups of each TP rank over CP."""
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    if cp == 1:
        return
    _require(
        model.seq_length % (2 * cp) == 0,
        f"--seq-length ({model.seq_length}) must be divisible by 2 x --context-parallel-size "
        f"({cp}) = {2 * cp}: each rank holds two of 2 x CP equal chunks",
    )
    if parallel.sequence_parallel:
        _require(
            model.seq_length % (cp * tp) == 0,
            f"--seq-length ({model.seq_length}) must be divisible by --context-parallel-size "
            f"({cp}) x --tensor-model-parallel-size ({tp}) = {cp * tp} with "
            "--sequence-parallel: each CP rank's part splits over TP",
        )
    if parallel.cp_comm_type == "a2a":
        for name, count in (
            ("--num-attention-heads", model.num_attention_heads),
            ("--num-query-groups", model.num_query_groups),
        ):
            _require(
                count % (tp * cp) == 0,
                f"--cp-comm-type a2a: {name} ({count}) / --tensor-model-parallel-size ({tp}) "
                f"must be divisible by --context-parallel-size ({cp}) (all-to-all splits each "
                "TP rank's heads over CP)",
            )


def validate_context_parallel_features(
    model: ModelConfig, parallel: ParallelConfig, data: object, kernels: object
) -> None:
    """What context-parallel training does not support yet, refused up front. (Attention
    dropout is supported: with --attention-dropout-rng layout-invariant, the CPU default, it is
    the one-rank run's; fused draws each rank's mask from the tensor-parallel stream.)"""
    cp = parallel.context_parallel_size
    if cp == 1:
        return
    _require(
        not (isinstance(kernels, KernelConfig) and kernels.transformer_impl != "local"),
        f"--transformer-impl transformer_engine with --context-parallel-size ({cp}): context "
        "parallelism runs megapipe's own attention; use --transformer-impl local",
    )


def validate_optimizer(opt: OptimizerConfig) -> None:
    _require(not (opt.bf16 and opt.fp16), "--fp16 and --bf16 are mutually exclusive")
    _require(
        opt.optimizer in ("adam", "sgd"), f"--optimizer {opt.optimizer!r} is not one of adam, sgd"
    )
    _require(opt.clip_grad >= 0, f"--clip-grad must be >= 0, got {opt.clip_grad}")
    _require(opt.weight_decay >= 0, f"--weight-decay must be >= 0, got {opt.weight_decay}")
    _require(opt.adam_eps > 0, f"--adam-eps must be positive, got {opt.adam_eps}")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(opt, name)
        _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")
    if opt.ddp_bucket_size is not None:
        _positive(ddp_bucket_size=opt.ddp_bucket_size)
    _positive(spiky_loss_factor=opt.spiky_loss_factor)
    _require(
        not opt.overlap_param_gather or opt.sharding in ("optim", "optim_grads_params"),
        "--overlap-param-gather requires sharded parameters: --use-distributed-optimizer "
        "(the updated shards' all-gather) or --use-torch-fsdp2 (the next layer's all-gather "
        "prefetched)",
    )
    if opt.fp16:
        if opt.loss_scale is not None:
            _positive(loss_scale=opt.loss_scale)
        _positive(
            initial_loss_scale=opt.initial_loss_scale,
            min_loss_scale=opt.min_loss_scale,
            loss_scale_window=opt.loss_scale_window,
            hysteresis=opt.hysteresis,
        )
        _require(
            opt.min_loss_scale <= opt.initial_loss_scale,
            f"--min-loss-scale ({opt.min_loss_scale}) must not exceed --initial-loss-scale "
            f"({opt.initial_loss_scale})",
        )


def validate_sharding(opt: OptimizerConfig, dp: int) -> None:
    """Sharded data parallelism's combinations that cannot run (the flags themselves were
    settled by arguments/sharding_flags.py)."""
    problem = hybrid_groups(dp, opt.num_distributed_optimizer_instances)
    _require(problem is None, str(problem))


def validate_training(training: TrainingConfig, data_parallel_size: int) -> None:
    _positive(
        micro_batch_size=training.micro_batch_size,
        global_batch_size=training.global_batch_size,
        log_interval=training.log_interval,
    )
    _require(training.train_iters >= 0, f"--train-iters must be >= 0, got {training.train_iters}")
    _require(
        training.train_iters > 0 or training.skip_train,
        f"--train-iters must be positive, got {training.train_iters}"
        + (
            ""
            if training.train_samples is None
            else f" (from --train-samples {training.train_samples})"
        ),
    )
    _require(training.lr >= 0, f"--lr must not be negative, got {training.lr}")
    per_step = training.micro_batch_size * data_parallel_size
    _require(
        training.global_batch_size % per_step == 0,
        f"--global-batch-size ({training.global_batch_size}) is not a multiple of "
        f"--micro-batch-size ({training.micro_batch_size}) x data-parallel size "
        f"({data_parallel_size}) = {per_step}",
    )
    batch_size_schedule_of(training, data_parallel_size).validate()
    _require(training.eval_iters >= 0, f"--eval-iters must be >= 0, got {training.eval_iters}")
    for name in ("eval_interval", "exit_interval", "exit_duration_in_mins"):
        value = getattr(training, name)
        if value is not None:
            _positive(**{name: value})
    if training.train_iters > 0:
        lr_schedule_of(training)
        decoupled_schedule_of(training)


def validate_logging(logging: LoggingConfig, world_size: int = 1) -> list[str]:
    """The logging flags; notes for those that have no effect as given."""
    _positive(
        tensorboard_log_interval=logging.tensorboard_log_interval,
        tensorboard_queue_size=logging.tensorboard_queue_size,
    )
    if logging.device_peak_tflops is not None:
        _positive(device_peak_tflops=logging.device_peak_tflops)
    path = logging.tensorboard_dir
    if path is not None:
        _require(
            not os.path.exists(path) or os.path.isdir(path),
            f"--tensorboard-dir {path}: exists and is not a directory",
        )
    return validate_monitoring(logging, world_size)


def validate_data(data: DataConfig) -> None:
    _require(
        not (data.data_path and data.train_data_path),
        "--data-path and --train-data-path cannot be combined: use --data-path with --split, "
        "or --train-data-path (with --valid-data-path, --test-data-path)",
    )
    _require(
        not (data.mock_data and data.real_data),
        "--mock-data cannot be combined with --data-path or --train-data-path",
    )
    _require(
        data.train_data_path or not (data.valid_data_path or data.test_data_path),
        "--valid-data-path and --test-data-path need --train-data-path",
    )
    flag_used = "--data-path" if data.data_path else "--train-data-path"
    _require(
        not data.real_data or data.tokenizer_type is not None,
        f"{flag_used} needs --tokenizer-type (the vocabulary size comes from the tokenizer)",
    )
    if data.vocab_size is not None:
        _positive(vocab_size=data.vocab_size)


def validate_pipeline(model: ModelConfig, parallel: ParallelConfig, num_microbatches: int) -> None:
    """The schedule can run these micro-batches (the layer split is checked by plan_stages)."""
    pp, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if v > 1 and pp == 1:
        raise ConfigError(
            f"virtual pipeline stages ({v} per rank) need --pipeline-model-parallel-size > 1"
        )
    validate_schedule(parallel.schedule, pp, v, num_microbatches)


def validate_recompute(recompute: RecomputeConfig, stage_map: StageMap) -> None:
    """--recompute-num-layers fits the layers of every pipeline stage (model chunk)."""
    if not recompute.full:
        return
    fewest = min(len(chunk) for chunks in stage_map.layers for chunk in chunks)
    _require(
        recompute.num_layers <= fewest,
        f"--recompute-num-layers {recompute.num_layers} exceeds the {fewest} layers of the "
        "smallest pipeline stage (model chunk)",
    )


def validate_configs(
    model: ModelConfig,
    parallel: ParallelConfig,
    training: TrainingConfig,
    world_size: int,
    optimizer: OptimizerConfig | None = None,
    **others: object,
) -> Configs:
    """Check every flag combination; return the settled configs or raise ConfigError.

    `others` are further Configs fields (data, logging, checkpoint, ...). Settles the one case
    Megatron only warns about: --sequence-parallel with TP=1 is dropped.
    """
    optimizer = optimizer or OptimizerConfig()
    validate_optimizer(optimizer)
    validate_model(model)
    validate_parallel(parallel, world_size)
    tp = parallel.tensor_model_parallel_size
    _divisible(
        ("--num-attention-heads", model.num_attention_heads), ("--tensor-model-parallel-size", tp)
    )
    _divisible(("--num-query-groups", model.num_query_groups), ("--tensor-model-parallel-size", tp))
    _divisible(("--ffn-hidden-size", model.ffn_hidden_size), ("--tensor-model-parallel-size", tp))
    notes: list[str] = []
    if parallel.sequence_parallel and tp == 1:
        notes.append(
            "--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it"
        )
        parallel = dataclasses.replace(parallel, sequence_parallel=False)
    if parallel.sequence_parallel:
        _divisible(("--seq-length", model.seq_length), ("--tensor-model-parallel-size", tp))
    validate_context_parallel(model, parallel)
    _require(
        parallel.pipeline_model_parallel_size <= model.num_layers,
        f"--pipeline-model-parallel-size ({parallel.pipeline_model_parallel_size}) exceeds "
        f"--num-layers ({model.num_layers})",
    )
    dp = parallel.data_parallel_size(world_size)
    validate_training(training, dp)
    schedule = batch_size_schedule_of(training, dp)
    validate_pipeline(model, parallel, training.num_microbatches(dp))
    pp, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    for batch_size in schedule.batch_sizes():  # a ramp-up runs the schedule at each of them
        try:
            validate_schedule(
                parallel.schedule, pp, v, batch_size // schedule.samples_per_microbatch_step
            )
        except ConfigError as error:
            raise ConfigError(
                f"{error} (at the ramped global batch size {batch_size} of --rampup-batch-size)"
            ) from None
    kernels = others.get("kernels")
    if isinstance(kernels, KernelConfig) and kernels.transformer_impl == "transformer_engine":
        _require(
            not model.apply_residual_connection_post_layernorm,
            "--apply-residual-connection-post-layernorm with --transformer-impl "
            "transformer_engine: TE fuses the norm into the QKV and fc1 linears, so its output "
            "is not there to add; use --transformer-impl local",
        )
    recompute = others.get("recompute")
    recompute = recompute if isinstance(recompute, RecomputeConfig) else RecomputeConfig()
    stage_map = plan_stages(
        model,
        parallel,
        micro_batch_size=training.micro_batch_size,
        num_microbatches=training.num_microbatches(dp),
        optimizer=optimizer,
        recompute=recompute,
        data_parallel_size=dp,
    )
    validate_recompute(recompute, stage_map)
    validate_sharding(optimizer, dp * parallel.context_parallel_size)  # shards over DP x CP
    logging = others.get("logging")
    if isinstance(logging, LoggingConfig):
        notes += validate_logging(logging, world_size)
    data = others.get("data")
    if isinstance(data, DataConfig):
        validate_data(data)
    validate_context_parallel_features(model, parallel, data, kernels)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return Configs(
        model,
        parallel,
        training,
        world_size,
        optimizer,
        tuple(notes),
        **others,  # type: ignore[arg-type]
        stage_map=stage_map,  # planned once here; the run is built on it
    )
