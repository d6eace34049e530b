"""Megatron flags -> validated configs: defaults as Megatron-LM's, one-line errors that name
the flags and their values for every impossible combination."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from megapipe.arguments import NO_DATASET, parse_args
from megapipe.errors import ConfigError
from tests.helpers import argv


def error(world_size: int = 1, **flags: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(argv(**flags), world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def assert_names(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"


# --- invalid combinations -------------------------------------------------------------------


def test_hidden_size_not_divisible_by_heads() -> None:
    message = error(hidden_size=100, num_attention_heads=3)
    assert message == "--hidden-size (100) must be divisible by --num-attention-heads (3)"


def test_heads_not_divisible_by_tensor_parallel_size() -> None:
    message = error(4, hidden_size=48, num_attention_heads=6, tensor_model_parallel_size=4)
    assert_names(message, "--num-attention-heads (6)", "--tensor-model-parallel-size (4)")


def test_query_groups_not_divisible_by_tensor_parallel_size() -> None:
    message = error(
        4,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        tensor_model_parallel_size=4,
    )
    assert_names(message, "--num-query-groups (2)", "--tensor-model-parallel-size (4)")


def test_heads_not_divisible_by_query_groups() -> None:
    message = error(num_attention_heads=8, group_query_attention=True, num_query_groups=3)
    assert_names(message, "--num-attention-heads (8)", "--num-query-groups (3)")


def test_global_batch_not_a_multiple_of_micro_batch_times_data_parallel() -> None:
    message = error(2, micro_batch_size=2, global_batch_size=6)
    assert_names(
        message, "--global-batch-size (6)", "--micro-batch-size (2)", "data-parallel size (2)"
    )


def test_seq_length_above_max_position_embeddings_with_learned_positions() -> None:
    message = error(seq_length=64, max_position_embeddings=32)
    assert_names(message, "--seq-length (64)", "--max-position-embeddings (32)")


def test_seq_length_above_max_position_embeddings_is_fine_with_rope() -> None:
    # rope has no learned table; tests/test_rotary.py trains such a model
    configs = parse_args(
        argv(seq_length=64, max_position_embeddings=32, position_embedding_type="rope"), 1
    )
    assert configs.model.seq_length == 64
    assert configs.model.position_embedding_type == "rope"


def test_unknown_position_embedding_type() -> None:
    message = error(position_embedding_type="alibi")
    assert_names(message, "--position-embedding-type", "alibi", "learned_absolute", "rope")


def test_unknown_normalization() -> None:
    message = error(normalization="BatchNorm")
    assert_names(message, "--normalization", "BatchNorm", "LayerNorm", "RMSNorm")


def test_world_size_not_divisible_by_tensor_times_pipeline_parallel() -> None:
    message = error(3, tensor_model_parallel_size=2)
    assert_names(message, "world size (3)", "--tensor-model-parallel-size (2)")


def test_layers_that_do_not_split_over_pipeline_stages() -> None:
    message = error(4, num_layers=6, pipeline_model_parallel_size=4)
    assert_names(message, "--num-layers (6)", "4 pipeline stages")


def test_first_and_last_stage_layers_that_do_not_add_up() -> None:
    message = error(
        4, num_layers=10, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3
    )
    assert_names(
        message,
        "--num-layers (10)",
        "--decoder-first-pipeline-num-layers (3)",
        "7 layers",
        "3 remaining stages",
    )


def test_virtual_stages_need_pipeline_parallelism() -> None:
    message = error(1, num_layers=4, num_virtual_stages_per_pipeline_rank=2)
    assert_names(message, "virtual pipeline stages (2 per rank)", "--pipeline-model-parallel-size")


def test_virtual_stage_size_must_divide_the_layers() -> None:
    message = error(
        2, num_layers=6, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2
    )
    assert_names(
        message,
        "--num-layers (6)",
        "--pipeline-model-parallel-size (2)",
        "--num-layers-per-virtual-pipeline-stage (2)",
    )


def test_interleaving_needs_a_multiple_of_pipeline_size_micro_batches() -> None:
    message = error(
        4,
        num_layers=8,
        pipeline_model_parallel_size=4,
        num_virtual_stages_per_pipeline_rank=2,
        global_batch_size=12,
    )
    assert_names(message, "micro-batches (6)", "--pipeline-model-parallel-size (4)", "4 or 8")


def test_unknown_pipeline_schedule() -> None:
    assert_names(
        error(2, pipeline_model_parallel_size=2, pipeline_schedule="zigzag"), "'zigzag'", "1f1b"
    )


def test_pipeline_flags_make_configs() -> None:
    configs = parse_args(
        argv(
            num_layers=8,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=2,
            global_batch_size=4,
        ),
        2,
    )
    assert configs.parallel.virtual_pipeline_model_parallel_size == 2
    assert configs.parallel.schedule == "interleaved-1f1b"
    assert parse_args(argv(pipeline_model_parallel_size=2), 2).parallel.schedule == "1f1b"


def test_missing_mock_data_means_no_dataset() -> None:
    assert error(mock_data=None) == NO_DATASET


def test_mock_data_needs_vocab_size() -> None:
    assert_names(error(vocab_size=None), "--mock-data", "--vocab-size")


def test_unknown_flag_and_bad_value_are_config_errors() -> None:
    assert_names(error(no_such_flag=1), "unrecognized arguments: --no-such-flag")
    assert_names(error(hidden_size="big"), "--hidden-size", "'big'")
    assert_names(error(num_layers=None), "required", "--num-layers")


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        ({"num_layers": 0}, ["--num-layers", "0"]),
        ({"micro_batch_size": -1}, ["--micro-batch-size", "-1"]),
        ({"hidden_dropout": 1.5}, ["--hidden-dropout", "1.5"]),
        ({"tensor_model_parallel_size": 0}, ["--tensor-model-parallel-size", "0"]),
        ({"distributed_backend": "mpi"}, ["--distributed-backend", "mpi"]),
    ],
)
def test_out_of_range_values_name_flag_and_value(flags: dict, fragments: list[str]) -> None:
    assert_names(error(**flags), *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is valid where CUDA is present")
def test_nccl_without_cuda() -> None:
    assert_names(error(distributed_backend="nccl"), "--distributed-backend nccl", "CUDA")


def test_nccl_order_emulation_is_for_gloo_only() -> None:
    message = error(distributed_backend="nccl", emulate_nccl_p2p_order=True)
    assert_names(message, "--emulate-nccl-p2p-order", "nccl", "--distributed-backend gloo")


# --- settings Megatron accepts with a warning -------------------------------------------------


def test_sequence_parallel_with_tp1_only_warns_and_is_turned_off() -> None:
    with pytest.warns(UserWarning, match="--sequence-parallel"):
        configs = parse_args(argv(sequence_parallel=True), 1)
    assert configs.parallel.sequence_parallel is False
    assert any("--sequence-parallel" in note for note in configs.warnings)


def test_sequence_parallel_is_kept_with_tp2() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs = parse_args(argv(sequence_parallel=True, tensor_model_parallel_size=2), 2)
    assert configs.parallel.sequence_parallel is True
    assert configs.warnings == ()


def test_num_query_groups_without_group_query_attention_warns_and_is_ignored() -> None:
    with pytest.warns(UserWarning, match=re.escape("--num-query-groups (2)")):
        configs = parse_args(argv(num_query_groups=2), 1)
    assert configs.model.num_query_groups == 4  # multi-head: one group per head
    assert any("--group-query-attention" in note for note in configs.warnings)


def test_group_query_attention() -> None:
    configs = parse_args(argv(group_query_attention=True, num_query_groups=2), 1)
    assert configs.model.num_query_groups == 2
    # Megatron's --num-query-groups defaults to 1 (multi-query attention) under GQA.
    assert parse_args(argv(group_query_attention=True), 1).model.num_query_groups == 1


# --- defaults and flag mapping ----------------------------------------------------------------


def test_defaults_match_megatron() -> None:
    configs = parse_args(argv(), 1)
    model, parallel, training = configs.model, configs.parallel, configs.training
    assert model.ffn_hidden_size == 4 * 64
    assert model.max_position_embeddings == 32
    assert model.num_query_groups == 4
    assert model.position_embedding_type == "learned_absolute"
    assert model.normalization == "LayerNorm"
    assert model.layernorm_epsilon == 1e-5
    assert model.rotary_base == 10000
    assert model.make_vocab_size_divisible_by == 128
    assert model.init_method_std == 0.02
    assert model.attention_dropout == 0.1 and model.hidden_dropout == 0.1
    assert model.add_bias_linear and not model.swiglu and not model.openai_gelu
    assert not model.untie_embeddings_and_output_weights
    assert parallel.tensor_model_parallel_size == 1
    assert parallel.pipeline_model_parallel_size == 1
    assert not parallel.sequence_parallel
    assert parallel.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")
    assert training.seed == 1234
    assert training.log_interval == 100
    assert training.global_batch_size == 2  # micro-batch x DP
    assert configs.warnings == ()


def test_openai_gelu_is_a_model_field_and_refused_with_swiglu() -> None:
    assert parse_args(argv(openai_gelu=True), 1).model.openai_gelu
    assert_names(error(openai_gelu=True, swiglu=True), "--openai-gelu", "--swiglu")


@pytest.mark.parametrize(("hidden", "ffn"), [(4096, 10880), (192, 512), (64, 128)])
def test_swiglu_ffn_rounding_as_megatron(hidden: int, ffn: int) -> None:
    # Megatron: int((4 * h * 2 / 3) / 64) * 64, keeping a 4h GeLU MLP's parameter count.
    configs = parse_args(argv(hidden_size=hidden, swiglu=True), 1)
    assert configs.model.ffn_hidden_size == ffn


def test_explicit_ffn_hidden_size_wins_over_swiglu_default() -> None:
    assert parse_args(argv(swiglu=True, ffn_hidden_size=96), 1).model.ffn_hidden_size == 96


def test_global_batch_size_defaults_to_micro_batch_times_data_parallel() -> None:
    configs = parse_args(argv(micro_batch_size=3, tensor_model_parallel_size=2), 8)
    assert configs.data_parallel_size == 4
    assert configs.training.global_batch_size == 12
    assert configs.training.num_microbatches(4) == 1
    configs = parse_args(argv(micro_batch_size=3, global_batch_size=24), 4)
    assert configs.training.num_microbatches(4) == 2


def test_every_flag_reaches_its_config_field() -> None:
    configs = parse_args(
        argv(
            num_layers=3,
            hidden_size=96,
            ffn_hidden_size=160,
            num_attention_heads=6,
            group_query_attention=True,
            num_query_groups=2,
            seq_length=48,
            max_position_embeddings=64,
            position_embedding_type="rope",
            rotary_base=500000,
            normalization="RMSNorm",
            layernorm_epsilon=1e-6,
            swiglu=True,
            untie_embeddings_and_output_weights=True,
            disable_bias_linear=True,
            make_vocab_size_divisible_by=64,
            init_method_std=0.01,
            attention_dropout=0.0,
            hidden_dropout=0.05,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            distributed_backend="gloo",
            micro_batch_size=1,
            global_batch_size=8,
            train_iters=7,
            lr=2e-4,
            seed=42,
            log_interval=5,
            vocab_size=1000,
        ),
        4,
    )
    m, p, t = configs.model, configs.parallel, configs.training
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (3, 96, 160)
    assert (m.num_attention_heads, m.num_query_groups) == (6, 2)
    assert (m.seq_length, m.max_position_embeddings) == (48, 64)
    assert (m.position_embedding_type, m.rotary_base) == ("rope", 500000)
    assert (m.normalization, m.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert m.swiglu and m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert (m.make_vocab_size_divisible_by, m.init_method_std) == (64, 0.01)
    assert (m.attention_dropout, m.hidden_dropout, m.vocab_size) == (0.0, 0.05, 1000)
    assert (p.tensor_model_parallel_size, p.sequence_parallel) == (2, True)
    assert p.distributed_backend == "gloo"
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (1, 8, 7)
    assert (t.lr, t.seed, t.log_interval) == (2e-4, 42, 5)
    assert configs.world_size == 4 and configs.data_parallel_size == 2


def test_help_speaks_megatron(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["-h"], 1)
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in ("--tensor-model-parallel-size", "--micro-batch-size", "--global-batch-size",
                 "--mock-data", "--num-query-groups", "--sequence-parallel"):  # fmt: skip
        assert name in text


# --- optimizer and precision ------------------------------------------------------------------


def test_fp16_and_bf16_together() -> None:
    assert_names(error(fp16=True, bf16=True), "--fp16", "--bf16")


def test_negative_clip_grad() -> None:
    assert_names(error(clip_grad=-1.0), "--clip-grad", "-1.0")


def test_unknown_optimizer() -> None:
    assert_names(error(optimizer="lion"), "--optimizer", "'lion'", "adam", "sgd")


def test_adam_beta_out_of_range() -> None:
    assert_names(error(adam_beta2=1.5), "--adam-beta2", "1.5")


def test_optimizer_defaults_follow_megatron() -> None:
    opt = parse_args(argv(), 1).optimizer
    assert (opt.optimizer, opt.weight_decay, opt.clip_grad) == ("adam", 0.01, 1.0)
    assert (opt.adam_beta1, opt.adam_beta2, opt.adam_eps) == (0.9, 0.999, 1e-8)
    assert (opt.initial_loss_scale, opt.loss_scale_window, opt.hysteresis) == (2.0**32, 1000, 2)
    assert opt.params_dtype == torch.float32
    assert parse_args(argv(bf16=True), 1).optimizer.params_dtype == torch.bfloat16


def test_training_product_defaults_follow_megatron() -> None:
    configs = parse_args(argv(), 1)
    training, logging = configs.training, configs.logging
    assert (training.eval_interval, training.eval_iters) == (1000, 100)
    assert training.rampup_batch_size is None and training.train_samples is None
    assert training.exit_interval is None and training.exit_duration_in_mins is None
    assert not training.exit_signal_handler and not training.skip_train
    assert configs.parallel.distributed_timeout_minutes == 10
    assert (logging.tensorboard_dir, logging.tensorboard_log_interval) == (None, 1)
    assert logging.tensorboard_queue_size == 1000
    assert logging.log_learning_rate_to_tensorboard and logging.log_loss_scale_to_tensorboard
    assert not logging.log_batch_size_to_tensorboard
    assert not logging.log_validation_ppl_to_tensorboard and not logging.log_timers_to_tensorboard
    assert not logging.log_throughput and logging.device_peak_tflops is None
    assert (configs.checkpoint.save, configs.checkpoint.load) == (None, None)


def test_receives_are_posted_ahead_unless_megatrons_no_overlap_flag_says_not() -> None:
    layout = {"pipeline_model_parallel_size": 2}
    assert parse_args(argv(**layout), 2).parallel.pipeline_receives_ahead
    off = parse_args(argv(**layout, no_overlap_p2p_communication=True), 2)
    assert not off.parallel.pipeline_receives_ahead
    on = parse_args(argv(**layout, overlap_p2p_communication=True), 2)
    assert on.parallel.pipeline_receives_ahead


SHARDING_SPELLINGS = [  # Megatron-LM's spellings -> (strategy, ZeRO-1's buffers, FSDP2)
    ({}, ("no_shard", False, False)),
    ({"use_distributed_optimizer": True}, ("optim", True, False)),
    ({"use_megatron_fsdp": True}, ("no_shard", False, False)),
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"},
     ("optim", True, False)),
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
     ("optim_grads", False, True)),
    ({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
     ("optim_grads_params", False, True)),
    ({"use_torch_fsdp2": True}, ("optim_grads_params", False, True)),
    ({"use_torch_fsdp2": True, "use_distributed_optimizer": True},
     ("optim_grads_params", False, True)),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "expected"), SHARDING_SPELLINGS)
def test_sharding_spellings_settle_on_one_strategy(flags: dict, expected: tuple) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = parse_args(argv(**flags), 2).optimizer
    assert (opt.sharding, opt.use_distributed_optimizer, opt.fsdp) == expected
