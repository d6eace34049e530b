"""Frozen configuration dataclasses: pure data, one per flag group.

Every field is named after the Megatron-LM flag it comes from (`hidden_size` <- `--hidden-size`),
so an error can name the flag the user typed. Validation composes on the flag side
(`megapipe.arguments.validation`), once, on every rank alike, before any process group or model
exists; this module imports nothing of megapipe but the error type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megapipe.errors import ConfigError, flag
from megapipe.moe_config import MoEConfig

__all__ = [
    "ConfigError",
    "Configs",
    "DataConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "KernelConfig",
    "ParallelConfig",
    "RecomputeConfig",
    "StageMap",
    "TrainingConfig",
    "flag",
]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
MOE_DROP_POLICIES = ("probs", "position")
MOE_DISPATCHERS = ("allgather", "alltoall")
# --emulate-nccl-p2p-order's rules (parallel/emulated_stream.py): what NCCL and CUDA allow at
# worst, emulated by the bare flag; "streams" alone is a stream per communicator and no more
NCCL_RULES = ("handshake", "one-queue")
NCCL_EMULATION_CHOICES = ("streams", *NCCL_RULES)


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
    kv_channels: int | None = None  # the attention head dim; None: hidden_size / heads
    qk_layernorm: bool = False  # a norm over each head of Q and K, before rotary
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # rope rotates the first int(head_dim x this) dims of a head
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # GPT-2's tanh-approximated GeLU instead of the exact erf one
    squared_relu: bool = False  # MLP activation relu(x)^2 (not gated)
    # The residual around attention (MLP) is the input (pre-MLP) norm's output, not its input.
    apply_residual_connection_post_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    moe: MoEConfig | None = None  # None: every layer has the dense MLP

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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` holds a mixture of experts instead of the dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def moe_ffn_hidden_size(self) -> int:
        """Each expert's ffn size: --moe-ffn-hidden-size, else --ffn-hidden-size."""
        if self.moe is None or self.moe.moe_ffn_hidden_size is None:
            return self.ffn_hidden_size
        return self.moe.moe_ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """--kv-channels, or hidden / heads without it (as Megatron-LM)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rope rotates (Megatron's int(kv x percent))."""
        return int(self.head_dim * self.rotary_percent)

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x TP, as Megatron."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is split: TP fastest-varying, then CP, then DP, then PP (Megatron's
    tp-cp-dp-pp; tp-dp-pp with CP 1)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Context parallelism: each sequence split over this many ranks (Megatron's load-balanced
    # 2 x CP chunks, megapipe/data/context_parallel_split.py); how its attention exchanges
    # keys and values (p2p ring, all_gather or a2a, Megatron's --cp-comm-type).
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    # Expert parallelism (MoE): the experts split over this many ranks of each DP x CP group
    # (Megatron's --expert-model-parallel-size), which exchange tokens by the MoE dispatcher.
    expert_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1  # model chunks per pipeline rank
    pipeline_schedule: str | None = None  # None: 1f1b, or interleaved-1f1b with virtual stages
    pipeline_partition: str = "uniform"  # or "balanced"
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_p2p_timeout: float = 300.0  # seconds before a stage gives up on its neighbour
    # Post each receive one compute unit before the unit that needs it (the transfer overlaps
    # that compute); False posts it just before (Megatron's --no-overlap-p2p-communication).
    pipeline_receives_ahead: bool = True
    # Debugging: run gloo's pipeline (and context-parallel ring) transfers under NCCL's rules
    # (NCCL_EMULATION_CHOICES; empty: no emulation), so that a posting order that would hang
    # on GPUs hangs on the CPU too.
    emulate_nccl_p2p_order: tuple[str, ...] = ()
    pipeline_trace: str | None = None  # Chrome-trace JSON of the measured schedule
    sequence_parallel: bool = False
    # TP linears overlap their backward collectives with the next matmul; False (Megatron's
    # --no-async-tensor-model-parallel-allreduce) waits at once, to measure what that buys.
    tp_comm_overlap: bool = True
    distributed_backend: str | None = None  # None: nccl when CUDA is present, else gloo
    distributed_timeout_minutes: float = 10.0  # collectives give up after this long
    # The watchdog (megapipe/training/watchdog.py): a step may run factor x the median step
    # time (at least min seconds), anything else max seconds (None: the collectives' timeout
    # plus a minute); factor 0 turns it off.
    watchdog_timeout_factor: float = 10.0
    watchdog_min_seconds: float = 60.0
    watchdog_max_seconds: float | None = None

    @property
    def schedule(self) -> str:
        """The pipeline schedule to run (Megatron picks interleaving from virtual stages)."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved-1f1b" if self.virtual_pipeline_model_parallel_size > 1 else "1f1b"

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """World size over TP x CP x PP (validation has checked that it divides)."""
        return world_size // (self.model_parallel_size * self.context_parallel_size)


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
    # Numerical faults (Megatron's flags): a NaN/Inf loss or gradient stops the run before the
    # optimizer step; a loss above spiky_loss_factor x the running mean is reported (and stops
    # the run with exit_on_spiky_loss).
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_factor: float = 10.0
    exit_on_spiky_loss: bool = False
    # --overlap-param-gather (distributed optimizer): the updated parameters' all-gather runs
    # asynchronously, each bucket waited for at the first forward that uses it.
    overlap_param_gather: bool = False
    # Sharded data parallelism (distributed/fsdp.py), as Megatron-LM names it: no_shard (DDP),
    # optim (ZeRO-1: use_distributed_optimizer), optim_grads (ZeRO-2) or optim_grads_params
    # (ZeRO-3); use `sharding`, which also reads use_distributed_optimizer.
    data_parallel_sharding_strategy: str = "no_shard"
    # Hybrid sharding: shard inside each of N groups of consecutive DP ranks (one NVLink
    # domain), replicate across them (outer strategy no_shard).
    num_distributed_optimizer_instances: int = 1
    outer_dp_sharding_strategy: str = "no_shard"

    @property
    def sharding(self) -> str:
        """The data-parallel sharding strategy in Megatron-LM's words (see the field)."""
        if self.data_parallel_sharding_strategy != "no_shard":
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def fsdp(self) -> bool:
        """Gradients (and parameters) sharded too: torch's FSDP2 runs the data parallelism."""
        return self.sharding in ("optim_grads", "optim_grads_params")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class TrainingConfig:
    """The optimisation loop: batch sizes, length, learning rate, seed, evaluation, exits.

    `train_iters` is always set (computed from --train-samples when that was given). The LR
    schedule's lengths are in iterations of the full global batch (Megatron's sample-based
    `--lr-*-samples` are converted), so they may be fractional.
    """

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    lr: float
    seed: int = 1234
    log_interval: int = 100
    train_samples: int | None = None  # the run's length in samples, when given that way
    rampup_batch_size: tuple[int, int, int] | None = None  # start, increment, ramp-up samples
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: float | None = None  # None: --train-iters
    lr_warmup_iters: float = 0
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    lr_wsd_decay_iters: float | None = None
    lr_wsd_decay_style: str = "exponential"
    # --decoupled-lr: the word embedding's and output layer's own peak LR (same schedule
    # shape), down to decoupled_min_lr (None: min_lr); None: they follow lr.
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    eval_interval: int | None = 1000  # None: never evaluate during training
    eval_iters: int = 100  # global batches per evaluation; 0 disables evaluation
    skip_train: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    exit_signal: int = 15  # SIGTERM; SIGINT is always handled too (--exit-signal-handler)
    exit_signal_handler_for_dataloader: bool = False  # accepted: samples are read in-process

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Micro-batches per step at the full global batch (validation checked it divides)."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


@dataclass(frozen=True)
class LoggingConfig:
    """Where and what to log beyond the stdout log line: throughput, TensorBoard, Weights &
    Biases, and which iterations to profile."""

    log_throughput: bool = False
    device_peak_tflops: float | None = None  # None: known from the device name, if any
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_learning_rate_to_tensorboard: bool = True
    log_loss_scale_to_tensorboard: bool = True
    log_batch_size_to_tensorboard: bool = False
    log_params_norm: bool = False  # the L2 norm of all parameters, each element counted once
    log_num_zeros_in_grad: bool = False  # zero elements of the fp32 main gradients
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    profile: bool = False  # capture iterations [profile_step_start, profile_step_end)
    use_pytorch_profiler: bool = False  # torch.profiler traces into tensorboard_dir, not nsys
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)  # global ranks that profile
    wandb_project: str | None = None  # Weights & Biases logging when set (the wandb package)
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None  # None: <--save>/wandb, else wandb's default ./wandb


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron's checkpoint flags: where to save and load, what to leave out."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    ckpt_step: int | None = None  # load this iteration instead of the tracker's
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load the weights only; iteration and data restart at 0
    # A resumed LR schedule that differs from the checkpoint's: the command line's
    # (override) or the checkpoint's (use_checkpoint); neither: an error (Megatron's rule).
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    exit_on_missing_checkpoint: bool = False
    async_save: bool = False  # write in a background thread; at most one save in flight


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


RECOMPUTE_MODULES = ("core_attn", "mlp")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation (Megatron's --recompute-* flags).

    granularity "full": keep only the input of each recomputed group of layers and run the
    group again in backward; method "uniform" groups a stage's layers `num_layers` at a time,
    "block" recomputes the first `num_layers` layers of each stage (model chunk) one by one.
    granularity "selective": recompute only `modules` inside every layer (core_attn: the
    attention core from q, k, v; mlp: the whole MLP from its input).
    """

    granularity: str | None = None  # None, "full" or "selective"
    method: str | None = None  # "uniform" or "block" (full only)
    num_layers: int | None = None
    modules: tuple[str, ...] = ("core_attn",)

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def selective(self, module: str) -> bool:
        """Whether `module` (one of RECOMPUTE_MODULES) is recomputed inside each layer."""
        return self.granularity == "selective" and module in self.modules

    def describe(self) -> str:
        """`full (block, 2 layers)`, `selective (core_attn, mlp)` or `none`."""
        if self.full:
            s = "" if self.num_layers == 1 else "s"
            return f"full ({self.method}, {self.num_layers} layer{s})"
        if self.granularity == "selective":
            return f"selective ({', '.join(self.modules)})"
        return "none"


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation each fusable op and attention use (Megatron's fusion flags,
    --attention-backend and --transformer-impl). The switches say what is allowed; what runs
    also depends on the device and on what is installed (megapipe/kernels/dispatch.py)."""

    attention_backend: str = "auto"  # auto, flash, fused, unfused or local
    attention_dropout_rng: str = "auto"  # auto (fused on CUDA), fused or layout-invariant
    # how context-parallel attention exchanges keys and values (ParallelConfig.cp_comm_type,
    # repeated here for the layers, which receive this config)
    cp_comm_type: str = "p2p"
    # ParallelConfig.emulate_nccl_p2p_order, repeated for the layers: the NCCL rules the CP
    # ring's transfers run under (gloo only, debugging)
    emulate_nccl_p2p_order: tuple[str, ...] = ()
    transformer_impl: str = "local"  # or transformer_engine
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    bias_swiglu_fusion: bool = True
    masked_softmax_fusion: bool = True
    rope_fusion: bool = True
    persist_layer_norm: bool = True
    cross_entropy_loss_fusion: bool = False
    # FP8 through TransformerEngine (--transformer-impl transformer_engine only): the format
    # (None: no FP8; "hybrid" = E4M3 forward, E5M2 gradients; "e4m3" everywhere) and its
    # delayed-scaling recipe, as Megatron's --fp8-* flags.
    fp8_format: str | None = None
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"  # or most_recent


@dataclass(frozen=True)
class StageMap:
    """layers[rank][chunk] = the global layer indices that model chunk holds.

    recompute[rank]: the activation recomputation the memory partition chose for that rank
    to even out memory; () where the flags' setting holds for every rank."""

    layers: tuple[tuple[range, ...], ...]
    recompute: tuple[RecomputeConfig, ...] = ()

    @property
    def pipeline_size(self) -> int:
        return len(self.layers)

    @property
    def num_chunks(self) -> int:
        return len(self.layers[0])

    def stage_ranges(self) -> list[range]:
        """Layer ranges in virtual-stage order (stage s = chunk * p + rank)."""
        p = self.pipeline_size
        return [self.layers[s % p][s // p] for s in range(p * self.num_chunks)]

    def describe(self) -> str:
        """The start-up map rank 0 prints: which layers each (rank, chunk) owns."""
        lines = ["pipeline layer map (rank, chunk): layers"]
        for rank, chunks in enumerate(self.layers):
            for chunk, layers in enumerate(chunks):
                n = len(layers)
                span = {0: "none", 1: f"{layers.start}"}.get(n, f"{layers.start}-{layers.stop - 1}")
                line = f"  ({rank}, {chunk}): {span} ({n} layer{'' if n == 1 else 's'})"
                if self.recompute and self.recompute[rank].granularity:
                    line += f", recomputing {self.recompute[rank].describe()}"
                lines.append(line)
        return "\n".join(lines)


@dataclass(frozen=True)
class Configs:
    """Everything one run needs, settled together against a world size."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    world_size: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    warnings: tuple[str, ...] = field(default=(), compare=False)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    arguments: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # for TensorBoard
    # the layer split over pipeline stages, planned once by validation (--pipeline-partition)
    stage_map: StageMap | None = field(default=None, compare=False, repr=False)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)
