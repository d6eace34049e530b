"""Frozen configuration dataclasses and their up-front validation.

Every field is named after the Megatron-LM flag it comes from (`hidden_size` <- `--hidden-size`),
so an error can name the flag the user typed. Validation runs once, on every rank alike, before
any process group or model exists: a bad combination exits with one line, never a hang.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class ConfigError(ValueError):
    """An impossible or inconsistent setting. The message names the flags and their values."""


def flag(name: str) -> str:
    """The command-line flag for a config field name: `hidden_size` -> `--hidden-size`."""
    return "--" + name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(**values: int | float) -> None:
    for name, value in values.items():
        _require(value > 0, f"{flag(name)} must be positive, got {value}")


def _divisible(numerator: tuple[str, int], denominator: tuple[str, int]) -> None:
    (n_name, n), (d_name, d) = numerator, denominator
    _require(n % d == 0, f"{n_name} ({n}) must be divisible by {d_name} ({d})")


@dataclass(frozen=True)
class ModelConfig:
    """The GPT architecture. Defaults follow Megatron-LM's."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int | None = None  # None: seq_length
    ffn_hidden_size: int | None = None  # None: 4h, or Megatron's 8h/3 rounding with SwiGLU
    num_query_groups: int | None = None  # None: multi-head attention (one group per head)
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.ffn_hidden_size is None:
            ffn = 4 * self.hidden_size
            if self.swiglu:  # Megatron keeps the parameter count of a 4h GeLU MLP
                ffn = int((4 * self.hidden_size * 2 / 3) / 64) * 64 or 2 * self.hidden_size
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x TP, as Megatron."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self) -> None:
        _positive(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            ffn_hidden_size=self.ffn_hidden_size,
            num_query_groups=self.num_query_groups,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            init_method_std=self.init_method_std,
        )
        _divisible(
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
        )
        _divisible(
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.num_query_groups),
        )
        _require(
            self.position_embedding_type in POSITION_EMBEDDING_TYPES,
            f"--position-embedding-type {self.position_embedding_type!r} is not one of "
            f"{', '.join(POSITION_EMBEDDING_TYPES)}",
        )
        _require(
            self.normalization in NORMALIZATIONS,
            f"--normalization {self.normalization!r} is not one of {', '.join(NORMALIZATIONS)}",
        )
        if self.position_embedding_type == "learned_absolute":
            _require(
                self.seq_length <= self.max_position_embeddings,
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings}) with learned absolute position embeddings",
            )
        if self.position_embedding_type == "rope":
            _require(
                self.head_dim % 2 == 0,
                f"rotary embeddings need an even head dim, got "
                f"--hidden-size/--num-attention-heads = {self.head_dim}",
            )
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split: TP fastest-varying, then DP, then PP (Megatron's tp-dp-pp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1  # model chunks per pipeline rank
    pipeline_schedule: str | None = None  # None: 1f1b, or interleaved-1f1b with virtual stages
    pipeline_partition: str = "uniform"  # or "balanced"
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_p2p_timeout: float = 300.0  # seconds before a stage gives up on its neighbour
    pipeline_trace: str | None = None  # Chrome-trace JSON of the measured schedule
    sequence_parallel: bool = False
    distributed_backend: str | None = None  # None: nccl when CUDA is present, else gloo

    @property
    def schedule(self) -> str:
        """The pipeline schedule to run (Megatron picks interleaving from virtual stages)."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved-1f1b" if self.virtual_pipeline_model_parallel_size > 1 else "1f1b"

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        _require(
            world_size % model_parallel == 0,
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size "
            f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
            f"({self.pipeline_model_parallel_size}) = {model_parallel}",
        )
        return world_size // model_parallel

    def validate(self, world_size: int) -> None:
        _positive(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
        )
        self.data_parallel_size(world_size)
        _require(
            self.distributed_backend in (None, "gloo", "nccl"),
            f"--distributed-backend {self.distributed_backend!r} is not one of gloo, nccl",
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, precision, gradient reduction and clipping. Defaults follow Megatron-LM's."""

    optimizer: str = "adam"  # AdamW (decoupled weight decay), as Megatron's "adam"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # 0 disables clipping
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = None  # elements; None: Megatron's 40M
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # a static fp16 loss scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def validate(self) -> None:
        _require(not (self.bf16 and self.fp16), "--fp16 and --bf16 are mutually exclusive")
        _require(
            self.optimizer in ("adam", "sgd"),
            f"--optimizer {self.optimizer!r} is not one of adam, sgd",
        )
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.adam_eps > 0, f"--adam-eps must be positive, got {self.adam_eps}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")
        if self.ddp_bucket_size is not None:
            _positive(ddp_bucket_size=self.ddp_bucket_size)
        if self.fp16:
            if self.loss_scale is not None:
                _positive(loss_scale=self.loss_scale)
            _positive(
                initial_loss_scale=self.initial_loss_scale,
                min_loss_scale=self.min_loss_scale,
                loss_scale_window=self.loss_scale_window,
                hysteresis=self.hysteresis,
            )


@dataclass(frozen=True)
class TrainingConfig:
    """The optimisation loop: batch sizes, iterations, learning rate, seed, logging."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    lr: float
    seed: int = 1234
    log_interval: int = 100
    mock_data: bool = True
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None: --train-iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"

    def lr_schedule(self):  # -> megapipe.training.lr_schedule.LRSchedule
        """The learning-rate schedule these flags describe (ConfigError if they conflict)."""
        from megapipe.training.lr_schedule import resolve_schedule

        return resolve_schedule(
            lr=self.lr,
            min_lr=self.min_lr,
            train_iters=self.train_iters,
            lr_decay_iters=self.lr_decay_iters,
            lr_warmup_iters=self.lr_warmup_iters,
            lr_warmup_fraction=self.lr_warmup_fraction,
            lr_decay_style=self.lr_decay_style,
            lr_wsd_decay_iters=self.lr_wsd_decay_iters,
            lr_wsd_decay_style=self.lr_wsd_decay_style,
            lr_warmup_init=self.lr_warmup_init,
            global_batch_size=self.global_batch_size,
        )

    def num_microbatches(self, data_parallel_size: int) -> int:
        per_step = self.micro_batch_size * data_parallel_size
        _require(
            self.global_batch_size % per_step == 0,
            f"--global-batch-size ({self.global_batch_size}) is not a multiple of "
            f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
            f"({data_parallel_size}) = {per_step}",
        )
        return self.global_batch_size // per_step

    def validate(self, data_parallel_size: int) -> None:
        _positive(
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            train_iters=self.train_iters,
            log_interval=self.log_interval,
        )
        _require(self.lr >= 0, f"--lr must not be negative, got {self.lr}")
        self.num_microbatches(data_parallel_size)
        self.lr_schedule()


@dataclass(frozen=True)
class DataConfig:
    """Where training samples come from: Megatron's data, tokenizer and masking flags.

    `data_path` and the per-split paths hold the words as given (`0.3 A 0.7 B` blends by
    weight); the files themselves are checked by megapipe.data when the flags are parsed.
    """

    mock_data: bool = False
    data_path: tuple[str, ...] = ()
    split: str = "969, 30, 1"
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    data_cache_path: str | None = None
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer's, or the mock data's without a tokenizer
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @property
    def real_data(self) -> bool:
        return bool(self.data_path or self.train_data_path)

    def validate(self) -> None:
        _require(
            not (self.data_path and self.train_data_path),
            "--data-path and --train-data-path cannot be combined: use --data-path with --split, "
            "or --train-data-path (with --valid-data-path, --test-data-path)",
        )
        _require(
            not (self.mock_data and self.real_data),
            "--mock-data cannot be combined with --data-path or --train-data-path",
        )
        _require(
            self.train_data_path or not (self.valid_data_path or self.test_data_path),
            "--valid-data-path and --test-data-path need --train-data-path",
        )
        flag_used = "--data-path" if self.data_path else "--train-data-path"
        _require(
            not self.real_data or self.tokenizer_type is not None,
            f"{flag_used} needs --tokenizer-type (the vocabulary size comes from the tokenizer)",
        )
        if self.vocab_size is not None:
            _positive(vocab_size=self.vocab_size)


@dataclass(frozen=True)
class Configs:
    """Everything one run needs, validated together against a world size."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    world_size: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    warnings: tuple[str, ...] = field(default=(), compare=False)
    data: DataConfig = field(default_factory=DataConfig)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)


def validate_configs(
    model: ModelConfig,
    parallel: ParallelConfig,
    training: TrainingConfig,
    world_size: int,
    optimizer: OptimizerConfig | None = None,
) -> Configs:
    """Check every flag combination; return the settled configs or raise ConfigError.

    Settles the one case Megatron only warns about: --sequence-parallel with TP=1 is dropped.
    """
    optimizer = optimizer or OptimizerConfig()
    optimizer.validate()
    model.validate()
    parallel.validate(world_size)
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
        parallel = ParallelConfig(**{**parallel.__dict__, "sequence_parallel": False})
    if parallel.sequence_parallel:
        _divisible(("--seq-length", model.seq_length), ("--tensor-model-parallel-size", tp))
    _require(
        parallel.pipeline_model_parallel_size <= model.num_layers,
        f"--pipeline-model-parallel-size ({parallel.pipeline_model_parallel_size}) exceeds "
        f"--num-layers ({model.num_layers})",
    )
    training.validate(parallel.data_parallel_size(world_size))
    _validate_pipeline(
        model, parallel, training.num_microbatches(parallel.data_parallel_size(world_size))
    )
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return Configs(model, parallel, training, world_size, optimizer, tuple(notes))


def _validate_pipeline(model: ModelConfig, parallel: ParallelConfig, num_microbatches: int) -> None:
    """The schedule can run these micro-batches, and the layers split over the stages."""
    from megapipe.pipeline.partition import partition_layers
    from megapipe.pipeline.schedules import validate_schedule

    pp, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if v > 1 and pp == 1:
        raise ConfigError(
            f"virtual pipeline stages ({v} per rank) need --pipeline-model-parallel-size > 1"
        )
    validate_schedule(parallel.schedule, pp, v, num_microbatches)
    partition_layers(
        model,
        pp,
        v,
        method=parallel.pipeline_partition,
        first=parallel.decoder_first_pipeline_num_layers,
        last=parallel.decoder_last_pipeline_num_layers,
    )
