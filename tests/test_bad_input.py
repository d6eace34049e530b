"""The bad-input catalogue: every input megapipe refuses, the one line it prints, and the fix.

Each row is a `Bad`: what the input is, a fragment of the one line that names it (the flag,
file, line or offset), and what the user should do (docs/troubleshooting.md's error tables are
this catalogue: `python tools/gen_troubleshooting.py` writes them, tests/test_docs.py checks
them). Rows whose rejection path is already tested one-for-one elsewhere name that test
(`tested=`) instead of running it twice; a test here checks that the named test exists and
holds the message. Everything else runs here:

- flags, in process through `parse_args` (what `pretrain_gpt.main` calls, before any process
  group exists: every rank prints the same line and exits 2);
- data files and tokenizer files named by the flags, the same way;
- JSONL input to the preprocessor, in process through `preprocess_data.main` under `run_tool`
  (exit 1), with the output directory checked unchanged;
- checkpoints, through the loaders, with the checkpoint checked unchanged after the refusal;
- once per command-line program, as a real subprocess: one line on stderr, the exit status, no
  traceback, nothing written; and (in process) with `--debug` or MEGAPIPE_DEBUG=1, the
  traceback above the same line.

A last test parses the flag side (arguments/, the LR and batch schedules, partition, schedules,
checkpointer, splits, blending) for every refusal and fails when one has no row here.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megapipe.arguments import parse_args
from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.legacy_torch import read_file, read_verified
from megapipe.checkpointing.shards import TensorShard
from megapipe.checkpointing.torch_dist import load_common, load_sharded, save_sharded
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.tool_cli import run_tool
from megapipe.errors import ConfigError, flag
from tests.helpers import Evil, argv, pretrain_env, refresh_checksums

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import preprocess_data  # noqa: E402


@dataclass(frozen=True)
class Bad:
    """One bad input: what it is, what the one line says (a fragment), what to do."""

    what: str
    says: str
    fix: str
    tested: str = ""  # "tests/test_x.py::test_name" when tested one-for-one there
    key: str = ""  # the fragment that test asserts, when shorter than `says`


def one_line(message: str) -> str:
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


# --- flags ----------------------------------------------------------------------------------
# (row, flags for tests.helpers.argv, extra raw argv, world size). The base run is tiny:
# 2 layers, hidden 64, 4 heads, seq 32, micro-batch 2, 10 iterations, mock data, vocabulary 256.

ELSEWHERE_FLAGS = [
    Bad("--wandb-project without the wandb package", "--wandb-project p needs the wandb "
        "package: pip install wandb", "pip install wandb (or megapipe's [wandb] extra), or drop "
        "--wandb-project", "tests/test_logging_flags.py::"
        "test_wandb_project_without_the_package_says_pip_install"),
    Bad("hidden size not divisible by the heads",
        "--hidden-size (100) must be divisible by --num-attention-heads (3)",
        "choose --hidden-size a multiple of --num-attention-heads",
        "tests/test_arguments.py::test_hidden_size_not_divisible_by_heads"),
    Bad("heads not divisible by TP", "--num-attention-heads (6) must be divisible by "
        "--tensor-model-parallel-size (4)",
        "--num-attention-heads (and --num-query-groups) must be multiples of "
        "--tensor-model-parallel-size", "tests/test_arguments.py::"
        "test_heads_not_divisible_by_tensor_parallel_size", key="--num-attention-heads (6)"),
    Bad("query groups not divisible by TP", "--num-query-groups (2) must be divisible by "
        "--tensor-model-parallel-size (4)",
        "choose --num-query-groups a multiple of --tensor-model-parallel-size",
        "tests/test_arguments.py::test_query_groups_not_divisible_by_tensor_parallel_size",
        key="--num-query-groups (2)"),
    Bad("heads not divisible by the query groups", "--num-attention-heads (8) must be "
        "divisible by --num-query-groups (3)",
        "choose --num-query-groups dividing --num-attention-heads",
        "tests/test_arguments.py::test_heads_not_divisible_by_query_groups",
        key="--num-attention-heads (8)"),
    Bad("global batch not a whole number of micro-batches per DP rank",
        "--global-batch-size (6) is not a multiple of --micro-batch-size (2) x "
            "data-parallel size (2) = 4", "make --global-batch-size a multiple of "
                "--micro-batch-size x DP "
        "(DP = world size / (TP x PP))", "tests/test_arguments.py::"
        "test_global_batch_not_a_multiple_of_micro_batch_times_data_parallel",
        key="--global-batch-size (6)"),
    Bad("sequence longer than the learned position table", "--seq-length (64) exceeds "
        "--max-position-embeddings (32) with learned absolute position embeddings",
        "raise --max-position-embeddings or use --position-embedding-type rope",
        "tests/test_arguments.py::"
        "test_seq_length_above_max_position_embeddings_with_learned_positions",
        key="--seq-length (64)"),
    Bad("unknown position embedding", "--position-embedding-type 'alibi' is not one of "
        "learned_absolute, rope, ...",
        "use learned_absolute or rope", "tests/test_arguments.py::"
        "test_unknown_position_embedding_type", key="--position-embedding-type"),
    Bad("unknown normalization", "--normalization 'BatchNorm' is not one of LayerNorm, RMSNorm",
        "use LayerNorm or RMSNorm",
        "tests/test_arguments.py::test_unknown_normalization", key="--normalization"),
    Bad("world size not a multiple of TP x PP", "world size (3) is not divisible by "
        "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (1) = 2",
        "launch a multiple of TP x PP ranks (--nproc_per_node x nodes)",
        "tests/test_arguments.py::test_world_size_not_divisible_by_tensor_times_pipeline_parallel",
        key="world size (3)"),
    Bad("layers that do not split over the pipeline stages", "--num-layers (6) is not "
        "divisible by 4 pipeline stages = 4; use a multiple of 4, "
            "--decoder-first/last-pipeline-num-layers, or the balanced partition",
        "use a multiple of PP layers, --decoder-first/last-pipeline-num-layers, or "
        "--pipeline-partition balanced", "tests/test_arguments.py::"
        "test_layers_that_do_not_split_over_pipeline_stages", key="4 pipeline stages"),
    Bad("first/last stage layers that leave an uneven rest", "--num-layers (10) minus "
        "--decoder-first-pipeline-num-layers (3) leaves 7 layers, which do not split evenly "
            "over the 3 remaining stages of --pipeline-model-parallel-size (4)",
        "choose --decoder-first/last-pipeline-num-layers so the rest splits evenly",
        "tests/test_arguments.py::test_first_and_last_stage_layers_that_do_not_add_up",
        key="3 remaining stages"),
    Bad("virtual stages without pipeline parallelism", "virtual pipeline stages (2 per "
        "rank) need --pipeline-model-parallel-size > 1",
        "virtual stages need --pipeline-model-parallel-size > 1",
        "tests/test_arguments.py::test_virtual_stages_need_pipeline_parallelism",
        key="virtual pipeline stages (2 per rank)"),
    Bad("virtual stage size that does not divide the layers",
        "--num-layers (6) is not divisible by --pipeline-model-parallel-size (2) x "
            "--num-layers-per-virtual-pipeline-stage (2)",
        "--num-layers must be a multiple of PP x --num-layers-per-virtual-pipeline-stage",
        "tests/test_arguments.py::test_virtual_stage_size_must_divide_the_layers",
        key="--num-layers-per-virtual-pipeline-stage (2)"),
    Bad("interleaving with micro-batches not a multiple of PP", "the interleaved schedule "
        "needs the number of micro-batches (6) to be a multiple of "
            "--pipeline-model-parallel-size (4): ... Use 4 or 8 micro-batches",
        "make global batch / (micro-batch x DP) a multiple of --pipeline-model-parallel-size",
        "tests/test_arguments.py::"
        "test_interleaving_needs_a_multiple_of_pipeline_size_micro_batches",
        key="micro-batches (6)"),
    Bad("unknown pipeline schedule", "pipeline schedule 'zigzag' is not one of "
        "no-pipelining, gpipe, 1f1b, interleaved-1f1b, ...", "use 1f1b, interleaved-1f1b, "
            "gpipe, ...",
        "tests/test_arguments.py::test_unknown_pipeline_schedule", key="'zigzag'"),
    Bad("no dataset", "no dataset: pass --mock-data",
        "give --data-path (or --train-data-path), or --mock-data --vocab-size N",
        "tests/test_pretrain_cli.py::test_main_reports_config_errors_in_one_line"),
    Bad("unknown flag, bad value, missing required flag", "unrecognized arguments: "
        "--no-such-flag 1 (--no-such-flag is not a flag)",
        "fix the spelling (the line suggests the closest flag); values must parse as the "
        "flag's type",
        "tests/test_arguments.py::test_unknown_flag_and_bad_value_are_config_errors",
        key="unrecognized arguments: --no-such-flag"),
    Bad("out-of-range sizes, dropouts, backends", "--hidden-dropout must be in [0, 1), got 1.5",
        "use a value in the range the line names", "tests/test_arguments.py::"
        "test_out_of_range_values_name_flag_and_value", key="--hidden-dropout"),
    Bad("--distributed-backend nccl without CUDA", "--distributed-backend nccl needs CUDA, "
        "which is not available here; use gloo",
        "use --distributed-backend gloo on CPU", "tests/test_arguments.py::test_nccl_without_cuda",
        key="--distributed-backend nccl"),
    Bad("--emulate-nccl-p2p-order on another backend than gloo", "--emulate-nccl-p2p-order "
        "emulates NCCL's ordering on gloo; this run's backend is nccl",
        "drop the flag (NCCL orders its transfers itself), or use --distributed-backend gloo",
        "tests/test_arguments.py::test_nccl_order_emulation_is_for_gloo_only",
        key="--emulate-nccl-p2p-order"),
    Bad("an --emulate-nccl-p2p-order rule that does not exist", "argument "
        "--emulate-nccl-p2p-order: invalid choice: 'two-streams' (choose from 'streams', "
        "'handshake', 'one-queue')",
        "name handshake, one-queue or streams, or none for both rules",
        "tests/test_context_parallel_nccl_order.py::"
        "test_an_unknown_emulation_rule_is_refused_by_name", key="invalid choice: 'two-streams'"),
    Bad("--openai-gelu with --swiglu", "--openai-gelu with --swiglu: the SwiGLU MLP has no "
        "GeLU (it uses SiLU)",
        "drop one: SwiGLU has no GeLU", "tests/test_arguments.py::"
        "test_openai_gelu_is_a_model_field_and_refused_with_swiglu", key="--openai-gelu"),
    Bad("--apply-residual-connection-post-layernorm with TransformerEngine layers",
        "--apply-residual-connection-post-layernorm with --transformer-impl transformer_engine: "
        "TE fuses the norm into the QKV and fc1 linears", "use --transformer-impl local",
        "tests/test_megatron_model_flags.py::"
        "test_post_layernorm_residual_is_refused_with_transformer_engine",
        key="--apply-residual-connection-post-layernorm with --transformer-impl"),
    Bad("--fp16 with --bf16", "--fp16 and --bf16 are mutually exclusive", "pick one precision",
        "tests/test_arguments.py::test_fp16_and_bf16_together", key="--fp16"),
    Bad("negative --clip-grad", "--clip-grad must be >= 0, got -1.0", "use 0 (off) or a "
        "positive norm",
        "tests/test_arguments.py::test_negative_clip_grad", key="--clip-grad"),
    Bad("unknown optimizer", "--optimizer 'lion' is not one of adam, sgd", "use adam or sgd",
        "tests/test_arguments.py::test_unknown_optimizer", key="--optimizer"),
    Bad("Adam beta out of range", "--adam-beta2 must be in [0, 1), got 1.5", "use a value "
        "in [0, 1)",
        "tests/test_arguments.py::test_adam_beta_out_of_range", key="--adam-beta2"),
    Bad("--transformer-impl transformer_engine without TransformerEngine", "--transformer-impl "
        "transformer_engine: TransformerEngine is not installed (it needs CUDA: pip install "
        "transformer_engine[pytorch]); use --transformer-impl local", "install TransformerEngine "
        "on a CUDA machine, or use --transformer-impl local", "tests/test_transformer_engine.py::"
        "test_transformer_engine_flag_without_te_names_what_is_missing", key="not installed"),
    Bad("--fp8-format without --transformer-impl transformer_engine", "--fp8-format hybrid "
        "needs --transformer-impl transformer_engine", "FP8 GEMMs are TransformerEngine's: add "
        "--transformer-impl transformer_engine (on a GPU)", "tests/test_transformer_engine.py::"
        "test_fp8_without_transformer_engine_is_refused_at_parse_time"),
    Bad("--fp8-format on a GPU below compute capability 8.9", "--fp8-format e4m3: FP8 needs a "
        "GPU of compute capability >= 8.9", "drop --fp8-format on A100 and older (bf16 instead)",
        "tests/test_transformer_engine.py::test_fp8_needs_compute_capability_8_9", key="8.9"),
    Bad("--fp8-amax-history-len 0", "--fp8-amax-history-len 0: must be at least 1",
        "use 1 or more (Megatron's default 1024)", "tests/test_transformer_engine.py::"
        "test_fp8_without_transformer_engine_is_refused_at_parse_time",
        key="--fp8-amax-history-len 0"),
    Bad("a negative --fp8-margin", "--fp8-margin -1: must be >= 0", "use 0 or more",
        "tests/test_transformer_engine.py::"
        "test_unknown_fp8_format_and_bad_recipe_values_are_named", key="--fp8-margin"),
    Bad("a MEGAPIPE_FAULT plan that does not parse", "expected action:moment:iteration:rank",
        "write kill|stop:moment:iteration:rank[@attempt] (a testing aid; unset it to train)",
        "tests/test_auto_resume.py::test_fault_plans_parse_and_refuse_by_name"),
    Bad("WORLD_SIZE that is not a number", "environment variable WORLD_SIZE='two'",
        "launch with torchrun, or unset WORLD_SIZE", "tests/test_pretrain_cli.py::"
        "test_main_reports_config_errors_in_one_line"),
    Bad("--load directory without a checkpoint and --exit-on-missing-checkpoint",
        "--exit-on-missing-checkpoint", "point --load at a directory with "
        "latest_checkpointed_iteration.txt, or drop the flag to start from scratch",
        "tests/test_checkpoint_resume.py::test_load_errors_are_one_line"),
    Bad("--ckpt-step naming an iteration that was not saved", "does not exist",
        "pick one of the iterations the line lists as saved there",
        "tests/test_checkpoint_resume.py::test_load_errors_are_one_line"),
]  # fmt: skip

B = Bad
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
FLAG_CASES: list[tuple[Bad, dict, list[str], int]] = [
    (B("--use-checkpoint-args without --load", "needs --load (the checkpoint whose arguments "
       "to use)", "add --load DIR (the checkpoint whose model flags to take)"),
     {"use_checkpoint_args": True}, [], 1),
    (B("--use-checkpoint-args with a --load that holds no checkpoint", "--use-checkpoint-args: "
       "--load", "point --load at a directory with latest_checkpointed_iteration.txt (megapipe's "
       "or Megatron-LM's)"),
     {"use_checkpoint_args": True}, ["--load", "/nonexistent-megapipe-dir"], 1),
    (B("--spiky-loss-factor 0", "--spiky-loss-factor must be positive, got 0.0",
       "use a factor above 1 (a loss that many times the running average is a spike)"),
     {"spiky_loss_factor": 0}, [], 1),
    (B("--overlap-param-gather without sharded parameters", "--overlap-param-gather "
       "requires sharded parameters", "add --use-distributed-optimizer or --use-torch-fsdp2 "
       "(or drop it)"), {"overlap_param_gather": True}, [], 1),
    (B("--overlap-param-gather with ZeRO-2", "--overlap-param-gather requires sharded "
       "parameters", "ZeRO-2 keeps the gathered parameters through the step: use "
       "optim_grads_params to prefetch"), {"overlap_param_gather": True, "use_megatron_fsdp":
       True, "data_parallel_sharding_strategy": "optim_grads"}, [], 2),
    (B("both spellings of sharded data parallelism", "--use-torch-fsdp2 and --use-megatron-fsdp "
       "are two spellings", "pass one of them"),
     {"use_torch_fsdp2": True, "use_megatron_fsdp": True}, [], 2),
    (B("--use-torch-fsdp2 with another strategy", "--use-torch-fsdp2 shards parameters "
       "(optim_grads_params); --data-parallel-sharding-strategy optim_grads contradicts it",
       "use --use-megatron-fsdp with that strategy"),
     {"use_torch_fsdp2": True, "data_parallel_sharding_strategy": "optim_grads"}, [], 2),
    (B("a sharding strategy without --use-megatron-fsdp", "--data-parallel-sharding-strategy "
       "optim_grads needs --use-megatron-fsdp", "add --use-megatron-fsdp"),
     {"data_parallel_sharding_strategy": "optim_grads"}, [], 2),
    (B("--use-distributed-optimizer with the no_shard strategy", "--data-parallel-sharding-"
       "strategy no_shard shards nothing: pass one", "drop one of the two"),
     {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "no_shard",
      "use_distributed_optimizer": True}, [], 2),
    (B("sharded gradients with the legacy torch format", "--ckpt-format torch (the legacy "
       "per-rank layout) cannot hold", "use --ckpt-format torch_dist"),
     {"use_torch_fsdp2": True, "ckpt_format": "torch"}, [], 2),
    (B("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor (Megatron-FSDP's own format) "
       "is not supported", "use --ckpt-format torch_dist, which every strategy loads"),
     {"ckpt_format": "fsdp_dtensor"}, [], 1),
    (B("--num-distributed-optimizer-instances 0", "--num-distributed-optimizer-instances must "
       "be >= 1, got 0", "use 1, or the number of groups to shard inside"),
     {"num_distributed_optimizer_instances": 0}, [], 1),
    (B("hybrid sharding that shards nothing", "hybrid sharding needs a sharded strategy",
       "add --use-distributed-optimizer or --use-torch-fsdp2"),
     {"num_distributed_optimizer_instances": 2}, [], 4),
    (B("--outer-dp-sharding-strategy optim", "--outer-dp-sharding-strategy optim: megapipe "
       "replicates across", "use no_shard (the default)"),
     {"outer_dp_sharding_strategy": "optim", "use_torch_fsdp2": True,
      "num_distributed_optimizer_instances": 2}, [], 4),
    (B("hybrid groups that do not divide DP", "--num-distributed-optimizer-instances (3) does "
       "not divide the data-parallel size (4)", "use a divisor of the data-parallel size"),
     {"use_torch_fsdp2": True, "num_distributed_optimizer_instances": 3}, [], 4),
    (B("a negative watchdog bound", "argument --watchdog-min-seconds: '-1' is not a "
       "non-negative number", "use seconds >= 0"), {"watchdog_min_seconds": -1}, [], 1),
    (B("--watchdog-max-seconds 0", "--watchdog-max-seconds must be positive, got 0.0",
       "use seconds > 0 (it bounds the first step, evaluations and saves)"),
     {"watchdog_max_seconds": 0}, [], 1),
    (B("an --exit-signal that is not a signal", "argument --exit-signal: 'SIGFOO' is not a "
       "signal that can be caught", "use a name like SIGUSR1 or USR1, or a number"),
     {"exit_signal": "SIGFOO"}, [], 1),
    (B("an absurd --num-layers", "--num-layers (9223372036854775808) exceeds 100,000, far "
       "beyond any model that trains", "use the real depth"), {"num_layers": 2**63}, [], 8),
    *[(B(f"--{name.replace('_', '-')} 0", f"--{name.replace('_', '-')} must be positive, got 0",
         "use a positive value"), {name: 0, **others}, [], 1)
      for name, others in (("num_layers", {}), ("hidden_size", {}), ("num_attention_heads", {}),
                           ("seq_length", {}), ("ffn_hidden_size", {}),
                           ("tensor_model_parallel_size", {}), ("context_parallel_size", {}),
                           ("micro_batch_size", {}),
                           ("global_batch_size", {}), ("initial_loss_scale", {"fp16": True}),
                           ("min_loss_scale", {"fp16": True}),
                           ("loss_scale_window", {"fp16": True}))],
    (B("--tensorboard-dir naming a file", ": exists and is not a directory",
       "point it at a directory (it is created if missing)"), {"tensorboard_dir": __file__}, [],
     1),
    (B("an interleaved schedule without virtual stages", "--pipeline-schedule interleaved-1f1b "
       "needs virtual pipeline stages", "add --num-virtual-stages-per-pipeline-rank N (or "
       "--num-layers-per-virtual-pipeline-stage), or use 1f1b"),
     {"pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved-1f1b"}, [], 2),
    (B("an empty --data-path", "--data-path needs at least one dataset prefix",
       "give the dataset prefix"), {"mock_data": None, "vocab_size": None},
     ["--data-path", "", *NULL_TOKENIZER], 1),
    (B("mock data without a vocabulary size", "--mock-data needs --vocab-size (or "
       "--tokenizer-type, whose vocabulary size is used)", "add --vocab-size N (or a tokenizer)"),
     {"vocab_size": None}, [], 1),
    (B("a Megatron-LM flag megapipe does not have", "--multi-latent-attention is a Megatron-LM "
       "flag that megapipe does not support yet", "remove the flag (the feature is not in "
       "megapipe)"), {}, ["--multi-latent-attention"], 1),
    (B("expert parallelism without experts", "--expert-model-parallel-size 2 needs "
       "--num-experts (experts to split)", "add --num-experts N, or leave "
       "--expert-model-parallel-size at 1"), {"expert_model_parallel_size": 2}, [], 2),
    (B("experts not divisible by EP", "--num-experts 3 is not divisible by "
       "--expert-model-parallel-size 2: each expert-parallel rank holds the same number of "
       "experts", "use an expert count that is a multiple of the EP size"),
     {"num_experts": 3, "moe_router_topk": 2, "expert_model_parallel_size": 2}, [], 2),
    (B("EP not dividing DP x CP", "--expert-model-parallel-size 4 does not divide "
       "data-parallel x context-parallel size 2 (world 2 / (TP 1 x PP 1)): EP ranks are taken "
       "from DP x CP", "choose an EP size that divides DP x CP (or launch more ranks)"),
     {"num_experts": 4, "expert_model_parallel_size": 4}, [], 2),
    (B("ZeRO-2/3 with EP equal to DP x CP", "--expert-model-parallel-size 2 equal to "
       "data-parallel x context-parallel size with ZeRO-2/3 (--use-torch-fsdp2 or "
       "--data-parallel-sharding-strategy optim_grads_params): no two ranks hold the same "
       "experts to shard them over; use --use-distributed-optimizer, or a smaller EP",
       "use --use-distributed-optimizer (ZeRO-1), or an EP size below DP x CP"),
     {"num_experts": 4, "expert_model_parallel_size": 2, "use_torch_fsdp2": True}, [], 2),
    (B("expert tensor parallelism other than TP", "--expert-tensor-parallel-size 2: experts "
       "are split like the dense MLP, so only --tensor-model-parallel-size (1) is supported yet",
       "leave --expert-tensor-parallel-size out (it follows TP)"),
     {"expert_tensor_parallel_size": 2}, [], 1),
    (B("--num-experts 0", "--num-experts 0: must be at least 1", "give 1 or more experts, or "
       "leave the flag out for a dense model"), {"num_experts": 0}, [], 1),
    (B("top-k above the expert count", "--moe-router-topk 3: must be between 1 and "
       "--num-experts 2", "choose --moe-router-topk <= --num-experts"),
     {"num_experts": 2, "moe_router_topk": 3}, [], 1),
    (B("a capacity factor <= 0", "--moe-expert-capacity-factor 0.0: must be > 0",
       "give a positive factor (1.0: each expert takes its even share), or leave it out "
       "(dropless)"), {"num_experts": 4, "moe_expert_capacity_factor": 0}, [], 1),
    (B("padding to capacity without a capacity", "--moe-pad-expert-input-to-capacity needs "
       "--moe-expert-capacity-factor", "add --moe-expert-capacity-factor F"),
     {"num_experts": 4, "moe_pad_expert_input_to_capacity": True}, [], 1),
    (B("an expert bias with softmax routing", "--moe-router-enable-expert-bias needs "
       "--moe-router-score-function sigmoid", "add --moe-router-score-function sigmoid"),
     {"num_experts": 4, "moe_router_enable_expert_bias": True}, [], 1),
    (B("top-1 softmax routing without pre-softmax", "--moe-router-topk 1 with softmax "
       "routing needs --moe-router-pre-softmax", "add --moe-router-pre-softmax"),
     {"num_experts": 4, "moe_router_topk": 1}, [], 1),
    (B("pre-softmax with sigmoid routing", "--moe-router-pre-softmax needs "
       "--moe-router-score-function softmax", "drop one of the two flags"),
     {"num_experts": 4, "moe_router_pre_softmax": True, "moe_router_score_function": "sigmoid"},
     [], 1),
    (B("an expert ffn size of 0", "--moe-ffn-hidden-size 0: must be positive",
       "give a positive size, or leave it out (--ffn-hidden-size)"),
     {"num_experts": 4, "moe_ffn_hidden_size": 0}, [], 1),
    (B("a negative MoE loss coefficient", "--moe-aux-loss-coeff -1.0 / --moe-z-loss-coeff None: "
       "must not be negative", "use coefficients >= 0"),
     {"num_experts": 4, "moe_aux_loss_coeff": -1}, [], 1),
    (B("a --moe-layer-freq list of the wrong length", "--moe-layer-freq [1,0,1]: 3 entries for "
       "--num-layers 2", "give one 0/1 entry per layer"),
     {"num_experts": 4, "moe_layer_freq": "[1,0,1]"}, [], 1),
    (B("a --moe-layer-freq that is no int or list", "--moe-layer-freq x: expected an int >= 1 "
       "or a list of 0/1", "write it as N or as [1,0,1,0]"),
     {"num_experts": 4, "moe_layer_freq": "x"}, [], 1),
    (B("expert parallelism saving the legacy checkpoint format", "--expert-model-parallel-size "
       "2 with --ckpt-format torch: the legacy format is written per (TP, PP) rank and would "
       "lose the other EP ranks' experts; use --ckpt-format torch_dist",
       "save with --ckpt-format torch_dist (the default), which any EP size loads"),
     {"num_experts": 4, "expert_model_parallel_size": 2, "save": "/tmp/x",
      "ckpt_format": "torch"}, [], 2),
    (B("an MoE capacity factor with context parallelism", "--moe-expert-capacity-factor 1.0 "
       "with --context-parallel-size 2: an expert's capacity is taken over the whole "
       "micro-batch, which no CP rank holds; drop the capacity factor (dropless) under CP",
       "drop --moe-expert-capacity-factor under CP (dropless routing)"),
     {"num_experts": 4, "context_parallel_size": 2, "moe_expert_capacity_factor": 1.0}, [], 2),
    (B("MoE with recomputation of the MLP", "--num-experts 4 with --recompute-granularity full "
       "(uniform, 1 layer): recomputing an MoE layer is not supported yet",
       "drop the recomputation flags (or recompute core_attn only)"),
     {"num_experts": 4, "recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1}, [], 1),
    (B("world size not a multiple of TP x CP x PP", "world size (2) is not divisible by "
       "--tensor-model-parallel-size (1) x --context-parallel-size (3) x "
       "--pipeline-model-parallel-size (1) = 3", "launch a multiple of TP x CP x PP ranks"),
     {"context_parallel_size": 3}, [], 2),
    (B("a sequence that does not split into 2 x CP chunks", "--seq-length (30) must be "
       "divisible by 2 x --context-parallel-size (2) = 4", "use a --seq-length that is a "
       "multiple of 2 x --context-parallel-size"),
     {"context_parallel_size": 2, "seq_length": 30}, [], 2),
    (B("CP with sequence parallelism and a sequence that does not split over CP x TP",
       "--seq-length (36) must be divisible by --context-parallel-size (2) x "
       "--tensor-model-parallel-size (4) = 8 with --sequence-parallel", "use a --seq-length "
       "that is a multiple of CP x TP (and of 2 x CP)"),
     {"context_parallel_size": 2, "tensor_model_parallel_size": 4, "sequence_parallel": True,
      "seq_length": 36}, [], 8),
    (B("--cp-comm-type a2a with heads per TP rank not divisible by CP", "--cp-comm-type a2a: "
       "--num-attention-heads (4) / --tensor-model-parallel-size (2) must be divisible by "
       "--context-parallel-size (4)", "use p2p or all_gather, or heads and query groups per TP "
       "rank that are multiples of CP"),
     {"context_parallel_size": 4, "tensor_model_parallel_size": 2, "cp_comm_type": "a2a"}, [],
     8),
    (B("--cp-comm-type a2a with query groups per TP rank not divisible by CP", "--cp-comm-type "
       "a2a: --num-query-groups (2) / --tensor-model-parallel-size (1) must be divisible by "
       "--context-parallel-size (4)", "use p2p or all_gather, or more query groups"),
     {"context_parallel_size": 4, "cp_comm_type": "a2a", "num_attention_heads": 8,
      "group_query_attention": True, "num_query_groups": 2}, [], 4),
    (B("a --cp-comm-type per layer", "--cp-comm-type p2p a2a: a communication type per layer "
       "is not supported yet", "give one type for every layer"),
     {}, ["--cp-comm-type", "p2p", "a2a"], 1),
    (B("--cp-comm-type a2a+p2p", "--cp-comm-type a2a+p2p (hierarchical context parallelism) "
       "is not supported yet", "use p2p, all_gather or a2a"),
     {"cp_comm_type": "a2a+p2p"}, [], 1),
    (B("an unknown --cp-comm-type", "--cp-comm-type 'ring' is not one of p2p, all_gather, a2a",
       "use p2p, all_gather or a2a"), {"cp_comm_type": "ring"}, [], 1),
    (B("a misspelt flag", "unrecognized arguments: --hiden-size 64 (--hiden-size: did you mean "
       "--hidden-size?)", "use the suggested flag"), {"hiden_size": 64}, [], 1),
    (B("both --train-iters and --train-samples", "pass exactly one of --train-iters and "
       "--train-samples", "keep one of them"), {"train_samples": 100}, [], 1),
    (B("neither --train-iters nor --train-samples", "pass exactly one of --train-iters and "
       "--train-samples", "add one of them"), {"train_iters": None}, [], 1),
    (B("an iteration-based LR length with --train-samples", "--lr-decay-iters needs "
       "--train-iters; with --train-samples use --lr-decay-samples",
       "use the -samples flag that matches --train-samples"),
     {"train_iters": None, "train_samples": 100, "lr_decay_iters": 5}, [], 1),
    (B("a sample-based LR length with --train-iters", "--lr-warmup-samples needs "
       "--train-samples; with --train-iters use --lr-warmup-iters",
       "use the -iters flag that matches --train-iters"), {"lr_warmup_samples": 10}, [], 1),
    (B("--train-iters 0", "--train-iters must be positive, got 0",
       "train at least one iteration (or --skip-train)"), {"train_iters": 0}, [], 1),
    (B("negative --train-iters", "--train-iters must be >= 0, got -1", "use a positive count"),
     {"train_iters": -1}, [], 1),
    (B("an unknown --ckpt-format", "--ckpt-format 'zarr': choose torch_dist",
       "use torch_dist (any layout) or torch (Megatron's per-rank files)"),
     {"ckpt_format": "zarr"}, [], 1),
    (B("--save-interval 0", "--save-interval must be positive, got 0",
       "use a positive interval"), {"save_interval": 0}, [], 1),
    (B("--use-flash-attn with another --attention-backend", "--use-flash-attn contradicts "
       "--attention-backend unfused", "drop one of them"),
     {"use_flash_attn": True, "attention_backend": "unfused"}, [], 1),
    (B("--transformer-impl transformer_engine", "--transformer-impl transformer_engine",
       "use --transformer-impl local (megapipe's own layers)"),
     {"transformer_impl": "transformer_engine"}, [], 1),
    (B("both virtual-stage flags", "pass one of --num-layers-per-virtual-pipeline-stage and "
       "--num-virtual-stages-per-pipeline-rank, not both", "keep one of them"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2,
      "num_layers_per_virtual_pipeline_stage": 1, "num_virtual_stages_per_pipeline_rank": 2},
     [], 2),
    (B("--num-virtual-stages-per-pipeline-rank 0", "--num-virtual-stages-per-pipeline-rank "
       "must be positive, got 0", "use 2 or more, or leave it out"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2,
      "num_virtual_stages_per_pipeline_rank": 0}, [], 2),
    (B("more pipeline stages than layers", "--pipeline-model-parallel-size (4) exceeds "
       "--num-layers (2)", "use at most one stage per layer"),
     {"pipeline_model_parallel_size": 4}, [], 4),
    (B("--decoder-first-pipeline-num-layers with virtual stages", "--decoder-first/last-"
       "pipeline-num-layers cannot be combined with virtual pipeline stages",
       "drop one of them"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2,
      "num_virtual_stages_per_pipeline_rank": 2, "decoder_first_pipeline_num_layers": 1,
      "global_batch_size": 4}, [], 2),
    (B("--pipeline-partition memory with virtual stages", "--pipeline-partition memory chooses "
       "every stage's layers itself", "use the uniform partition with virtual stages"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2, "pipeline_partition": "memory",
      "num_virtual_stages_per_pipeline_rank": 2, "global_batch_size": 4}, [], 2),
    (B("--pipeline-partition balanced with first/last stage layers", "--decoder-first/last-"
       "pipeline-num-layers and the balanced partition are alternatives; pass one",
       "keep one of them"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2, "pipeline_partition": "balanced",
      "decoder_first_pipeline_num_layers": 1}, [], 2),
    (B("an unknown --pipeline-partition", "pipeline partition method 'zigzag' is not uniform, "
       "balanced or memory", "use uniform, balanced or memory"),
     {"pipeline_model_parallel_size": 2, "pipeline_partition": "zigzag"}, [], 2),
    (B("--pipeline-schedule no-pipelining with PP > 1", "schedule no-pipelining needs "
       "--pipeline-model-parallel-size 1, got 2", "use 1f1b (or PP 1)"),
     {"pipeline_model_parallel_size": 2, "pipeline_schedule": "no-pipelining"}, [], 2),
    (B("a one-chunk schedule with virtual stages", "runs one model chunk per rank; virtual "
       "stages (2) need the interleaved-1f1b", "use --pipeline-schedule "
       "interleaved-1f1b"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2, "pipeline_schedule": "1f1b",
      "num_virtual_stages_per_pipeline_rank": 2, "global_batch_size": 4}, [], 2),
    (B("--recompute-activations with --recompute-granularity full", "--recompute-activations "
       "(selective) and --recompute-granularity full: pick one", "keep one of them"),
     {"recompute_activations": True, "recompute_granularity": "full"}, [], 1),
    (B("--recompute-method without full granularity", "--recompute-method uniform needs "
       "--recompute-granularity full (it is not set)", "add --recompute-granularity full"),
     {"recompute_method": "uniform"}, [], 1),
    (B("--recompute-num-layers without full granularity", "--recompute-num-layers 1 needs "
       "--recompute-granularity full", "add --recompute-granularity full"),
     {"recompute_num_layers": 1}, [], 1),
    (B("full recomputation without a method", "--recompute-granularity full needs "
       "--recompute-method uniform|block", "add --recompute-method uniform or block"),
     {"recompute_granularity": "full"}, [], 1),
    (B("full recomputation without a layer count", "--recompute-granularity full needs "
       "--recompute-num-layers N", "add --recompute-num-layers N"),
     {"recompute_granularity": "full", "recompute_method": "uniform"}, [], 1),
    (B("--recompute-num-layers 0", "--recompute-num-layers 0: must be at least 1",
       "use 1 or more"), {"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 0}, [], 1),
    (B("--recompute-num-layers above a stage's layers", "--recompute-num-layers 3 exceeds the "
       "2 layers of the smallest pipeline stage", "use at most the layers of the smallest stage"),
     {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
     [], 1),
    (B("--recompute-modules without selective granularity", "--recompute-modules needs "
       "--recompute-granularity selective (it is not set)", "add --recompute-granularity "
       "selective"), {"recompute_modules": "mlp"}, [], 1),
    (B("a Megatron recompute module megapipe lacks", "--recompute-modules moe: megapipe "
       "recomputes only", "use the modules the line lists"),
     {"recompute_granularity": "selective", "recompute_modules": "moe"}, [], 1),
    (B("an unknown recompute module", "--recompute-modules attn: unknown module; choose from",
       "use the modules the line lists"),
     {"recompute_granularity": "selective", "recompute_modules": "attn"}, [], 1),
    (B("--recompute-modules with no module", "--recompute-modules: name at least one module",
       "name a module, or leave the flag out"),
     {"recompute_granularity": "selective"}, ["--recompute-modules"], 1),
    (B("a ramp-up with a zero increment", "--rampup-batch-size 2 0 8: start and increment "
       "must be positive and the ramp-up samples non-negative", "use positive start and increment"),
     {"global_batch_size": 8}, ["--rampup-batch-size", "2", "0", "8"], 1),
    (B("a ramp-up starting above the global batch", "--rampup-batch-size start (16) exceeds "
       "--global-batch-size (8)", "start below --global-batch-size"),
     {"global_batch_size": 8}, ["--rampup-batch-size", "16", "2", "8"], 1),
    (B("a ramp-up that misses the global batch", "--global-batch-size (8) minus "
       "--rampup-batch-size start (2) must be a multiple of its increment (4)",
       "choose start and increment that reach --global-batch-size"),
     {"global_batch_size": 8}, ["--rampup-batch-size", "2", "4", "8"], 1),
    (B("a ramp-up step that is not whole micro-batches per rank", "--rampup-batch-size start (1) "
       "must be a multiple of --micro-batch-size (2)", "use multiples of micro-batch x DP"),
     {"global_batch_size": 8}, ["--rampup-batch-size", "1", "1", "8"], 1),
    (B("a ramp-up the interleaved schedule cannot run", "(at the ramped global batch size 3 of "
       "--rampup-batch-size)", "ramp in steps of micro-batch x DP x PP"),
     {"num_layers": 4, "pipeline_model_parallel_size": 2, "micro_batch_size": 1,
      "num_virtual_stages_per_pipeline_rank": 2, "global_batch_size": 4},
     ["--rampup-batch-size", "2", "1", "8"], 2),
    (B("--min-lr above --lr", "--min-lr (1.0) must not exceed --lr (0.001)",
       "lower --min-lr"), {"min_lr": 1.0}, [], 1),
    (B("a negative --lr", "--lr must not be negative, got -1.0", "use a positive --lr"),
     {"lr": -1}, [], 1),
    (B("a negative --min-lr", "--min-lr must not be negative, got -1.0", "use 0 or more"),
     {"min_lr": -1}, [], 1),
    (B("--lr-warmup-init above --lr", "--lr-warmup-init (1.0) must be in [0, --lr (0.001)]",
       "lower --lr-warmup-init"), {"lr_warmup_init": 1}, [], 1),
    (B("an unknown --lr-decay-style", "--lr-decay-style 'step' is not one of",
       "use a style the line lists"), {"lr_decay_style": "step"}, [], 1),
    (B("an unknown --lr-wsd-decay-style", "--lr-wsd-decay-style 'step' is not one of",
       "use a style the line lists"), {"lr_wsd_decay_style": "step"}, [], 1),
    (B("warm-up as long as the decay", "--lr-warmup-iters (10) must be less than "
       "--lr-decay-iters (10), which defaults to --train-iters", "shorten the warm-up"),
     {"lr_warmup_iters": 10}, [], 1),
    (B("--lr-decay-iters 0", "--lr-decay-iters must be positive, got 0",
       "use a positive length (or leave it out: --train-iters)"), {"lr_decay_iters": 0}, [], 1),
    (B("a negative --lr-warmup-iters", "--lr-warmup-iters must not be negative, got -1",
       "use 0 or more"), {"lr_warmup_iters": -1}, [], 1),
    (B("--lr-warmup-fraction with --lr-warmup-iters", "give one of --lr-warmup-iters (2) and "
       "--lr-warmup-fraction (0.1), not both", "keep one of them"),
     {"lr_warmup_iters": 2, "lr_warmup_fraction": 0.1}, [], 1),
    (B("--lr-warmup-fraction outside [0, 1)", "--lr-warmup-fraction must be in [0, 1), got 1.5",
       "use a fraction below 1"), {"lr_warmup_fraction": 1.5}, [], 1),
    (B("--lr-decay-style WSD without its length", "--lr-decay-style WSD needs "
       "--lr-wsd-decay-iters", "add --lr-wsd-decay-iters N"), {"lr_decay_style": "WSD"}, [], 1),
    (B("a WSD decay longer than the schedule", "--lr-wsd-decay-iters (20) must not exceed "
       "--lr-decay-iters (10)", "shorten --lr-wsd-decay-iters"),
     {"lr_decay_style": "WSD", "lr_wsd_decay_iters": 20}, [], 1),
    (B("a negative WSD decay", "--lr-wsd-decay-iters must not be negative, got -1",
       "use 0 or more"), {"lr_decay_style": "WSD", "lr_wsd_decay_iters": -1}, [], 1),
    (B("a negative --eval-iters", "--eval-iters must be >= 0, got -1", "use 0 (off) or more"),
     {"eval_iters": -1}, [], 1),
    (B("--eval-interval 0", "--eval-interval must be positive, got 0", "use a positive interval"),
     {"eval_interval": 0}, [], 1),
    (B("--exit-interval 0", "--exit-interval must be positive, got 0", "use a positive interval"),
     {"exit_interval": 0}, [], 1),
    (B("--exit-duration-in-mins 0", "--exit-duration-in-mins must be positive, got 0.0",
       "use a positive duration"), {"exit_duration_in_mins": 0}, [], 1),
    (B("--log-interval 0", "--log-interval must be positive, got 0", "use a positive interval"),
     {"log_interval": 0}, [], 1),
    (B("a negative --weight-decay", "--weight-decay must be >= 0, got -1.0", "use 0 or more"),
     {"weight_decay": -1}, [], 1),
    (B("--adam-eps 0", "--adam-eps must be positive, got 0.0", "use e.g. 1e-8"),
     {"adam_eps": 0}, [], 1),
    (B("--ddp-bucket-size 0", "--ddp-bucket-size must be positive, got 0",
       "use a positive element count"), {"ddp_bucket_size": 0}, [], 1),
    (B("--fp16 with --loss-scale 0", "--loss-scale must be positive, got 0.0",
       "use a positive static scale, or leave it out (dynamic)"),
     {"fp16": True, "loss_scale": 0}, [], 1),
    (B("--fp16 with a non-positive dynamic-scale setting", "--hysteresis must be positive, got 0",
       "use positive --initial-loss-scale, --min-loss-scale, --loss-scale-window, "
       "--hysteresis"), {"fp16": True, "hysteresis": 0}, [], 1),
    (B("--min-loss-scale above --initial-loss-scale", "--min-loss-scale (8.0) must not exceed "
       "--initial-loss-scale (4.0)", "lower --min-loss-scale"),
     {"fp16": True, "initial_loss_scale": 4, "min_loss_scale": 8}, [], 1),
    (B("--init-method-std 0", "--init-method-std must be positive, got 0.0",
       "use e.g. 0.02"), {"init_method_std": 0}, [], 1),
    (B("--make-vocab-size-divisible-by 0", "--make-vocab-size-divisible-by must be positive",
       "use e.g. 128"), {"make_vocab_size_divisible_by": 0}, [], 1),
    (B("--num-query-groups 0 with --group-query-attention", "--num-query-groups must be "
       "positive, got 0", "use 1 (multi-query) or more"),
     {"group_query_attention": True, "num_query_groups": 0}, [], 1),
    (B("FFN size not divisible by TP", "--ffn-hidden-size (65) must be divisible by "
       "--tensor-model-parallel-size (2)", "choose --ffn-hidden-size a multiple of TP"),
     {"ffn_hidden_size": 65, "tensor_model_parallel_size": 2}, [], 2),
    (B("sequence length not divisible by TP with --sequence-parallel", "--seq-length (34) must "
       "be divisible by --tensor-model-parallel-size (4)", "choose --seq-length a multiple of "
       "TP"), {"seq_length": 34, "max_position_embeddings": 64, "sequence_parallel": True,
               "tensor_model_parallel_size": 4}, [], 4),
    (B("rotary embeddings with an odd head size", "rotary embeddings need an even head dim, got "
       "--hidden-size/--num-attention-heads = 3", "make hidden size / heads even"),
     {"hidden_size": 12, "position_embedding_type": "rope"}, [], 1),
    (B("--use-rotary-position-embeddings with learned positions",
       "--use-rotary-position-embeddings contradicts --position-embedding-type learned_absolute",
       "drop one: the older flag means --position-embedding-type rope"),
     {"use_rotary_position_embeddings": True, "position_embedding_type": "learned_absolute"},
     [], 1),
    (B("--squared-relu with --swiglu", "--squared-relu with --swiglu: the MLP has one "
       "activation", "pick one MLP activation"), {"squared_relu": True, "swiglu": True}, [], 1),
    (B("--squared-relu with --openai-gelu", "--squared-relu with --openai-gelu: the MLP has "
       "one activation", "pick one MLP activation"),
     {"squared_relu": True, "openai_gelu": True}, [], 1),
    (B("--kv-channels 0", "--kv-channels must be positive, got 0",
       "use the head dimension (default hidden size / heads)"), {"kv_channels": 0}, [], 1),
    (B("--rotary-percent outside (0, 1]", "--rotary-percent must be in (0, 1], got 1.5",
       "use a fraction of the head dimension in (0, 1]"),
     {"rotary_percent": 1.5, "position_embedding_type": "rope"}, [], 1),
    (B("--rotary-percent without rotary embeddings", "--rotary-percent 0.5 needs rotary "
       "embeddings (--position-embedding-type rope)",
       "add --position-embedding-type rope, or drop --rotary-percent"),
     {"rotary_percent": 0.5}, [], 1),
    (B("--rotary-percent that rotates an odd number of dims", "rotary embeddings need an even, "
       "positive number of rotated dims, got int(--kv-channels 10 x --rotary-percent 0.1) = 1",
       "choose --rotary-percent so that kv-channels x percent is even"),
     {"kv_channels": 10, "rotary_percent": 0.1, "position_embedding_type": "rope"}, [], 1),
    (B("a negative dropout", "--attention-dropout must be in [0, 1), got -0.1",
       "use a probability in [0, 1)"), {"attention_dropout": -0.1}, [], 1),
    (B("--pipeline-model-parallel-size 0", "--pipeline-model-parallel-size must be positive, "
       "got 0", "use 1 or more"), {"pipeline_model_parallel_size": 0}, [], 1),
    (B("--distributed-timeout-minutes 0", "--distributed-timeout-minutes must be positive, "
       "got 0.0", "use a positive timeout"), {"distributed_timeout_minutes": 0}, [], 1),
    (B("--tensorboard-log-interval 0", "--tensorboard-log-interval must be positive, got 0",
       "use a positive interval"), {"tensorboard_log_interval": 0}, [], 1),
    (B("--tensorboard-queue-size 0", "--tensorboard-queue-size must be positive, got 0",
       "use a positive size"), {"tensorboard_queue_size": 0}, [], 1),
    (B("both resumed-schedule options", "--override-opt_param-scheduler and "
       "--use-checkpoint-opt_param-scheduler exclude each other",
       "keep one: the command line's schedule (override) or the checkpoint's"),
     {}, ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1),
    (B("a negative --decoupled-lr", "--decoupled-lr must not be negative, got -1.0",
       "use a learning rate >= 0"), {"decoupled_lr": -1}, [], 1),
    (B("a negative --decoupled-min-lr", "--decoupled-min-lr must not be negative, got -1.0",
       "use a learning rate >= 0"), {"decoupled_lr": 1e-3, "decoupled_min_lr": -1}, [], 1),
    (B("--decoupled-min-lr above --decoupled-lr", "--decoupled-min-lr (0.001) must not exceed "
       "--decoupled-lr (0.0001)", "lower --decoupled-min-lr (it defaults to --min-lr)"),
     {"decoupled_lr": 1e-4, "decoupled_min_lr": 1e-3}, [], 1),
    (B("--lr-warmup-init above --decoupled-lr", "--lr-warmup-init (0.001) must not exceed "
       "--decoupled-lr (0.0001)", "both schedules warm up from --lr-warmup-init: lower it"),
     {"decoupled_lr": 1e-4, "lr_warmup_init": 1e-3}, [], 1),
    (B("--profile --use-pytorch-profiler without --tensorboard-dir", "--profile with "
       "--use-pytorch-profiler needs --tensorboard-dir (the trace is written there)",
       "add --tensorboard-dir DIR (the trace opens in TensorBoard's profile plugin or "
       "Perfetto)"), {"profile": True, "use_pytorch_profiler": True}, [], 1),
    (B("a --profile-step-end not after --profile-step-start", "--profile-step-end (5) must be "
       "greater than --profile-step-start (5)", "the profiled iterations are [start, end): "
       "make the end larger"), {"profile": True, "profile_step_start": 5,
                                "profile_step_end": 5}, [], 1),
    (B("--profile-step-start 0", "--profile-step-start must be positive (iterations count "
       "from 1), got 0", "start at iteration 1 or later"),
     {"profile": True, "profile_step_start": 0}, [], 1),
    (B("a --profile-ranks rank outside the world", "--profile-ranks 4: no such rank in a world "
       "of 2 (ranks 0..1)", "list global ranks below the world size"),
     {"profile": True, "profile_ranks": 4}, [], 2),
    (B("--wandb-project without --wandb-exp-name", "--wandb-project p needs --wandb-exp-name "
       "(the run's name in the project)", "add --wandb-exp-name NAME"),
     {"wandb_project": "p"}, [], 1),
    (B("--device-peak-tflops 0", "--device-peak-tflops must be positive, got 0.0",
       "give the device's peak (e.g. 989 for an H100 in bf16)"),
     {"device_peak_tflops": 0}, [], 1),
    (B("--valid-data-path without --train-data-path", "--valid-data-path and --test-data-path "
       "need --train-data-path", "use --train-data-path with them, or --data-path with --split"),
     {"mock_data": None, "data_path": "A", "valid_data_path": "A"}, [], 1),
    (B("--vocab-size 0", "--vocab-size must be positive, got 0", "use the vocabulary size"),
     {"vocab_size": 0}, [], 1),
    (B("a --split that is not numbers", "--split '..': only numbers separated by commas are "
       "allowed", "write it as 969,30,1"), {"split": ".."}, [], 1),
    (B("a --split with four parts", "--split '1,2,3,4': expected 1 to 3 numbers",
       "give train,valid,test shares"), {"split": "1,2,3,4"}, [], 1),
    (B("a --split that sums to zero", "--split '0,0,0': the parts sum to zero",
       "give the training split a share"), {"split": "0,0,0"}, [], 1),
]  # fmt: skip


def _flag_id(case: tuple) -> str:
    return case[0].what


def flag_error(flags: dict, extra: list[str], world_size: int) -> str:
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parse_args(argv(**flags) + extra, world_size)
    return one_line(str(info.value))


@pytest.mark.parametrize("case", FLAG_CASES, ids=_flag_id)
def test_bad_flags(case: tuple) -> None:
    bad, flags, extra, world_size = case
    message = flag_error(flags, extra, world_size)
    assert bad.says in message, (bad.says, message)


# --- data files and tokenizer files named by the flags ---------------------------------------

ELSEWHERE_DATA = [
    Bad("--data-path naming a prefix with no .idx", ".idx: no such file (the .idx of an indexed "
        "dataset)", "--data-path takes the prefix without .bin/.idx (preprocess_data.py writes "
        "{output_prefix}_text_document)",
        "tests/test_data_training.py::test_bad_data_flags_are_one_line_errors"),
    Bad("--data-path without a tokenizer", "--data-path needs --tokenizer-type (the vocabulary "
        "size comes from the tokenizer)", "add --tokenizer-type (and its model or vocab files)",
        "tests/test_data_training.py::test_bad_data_flags_are_one_line_errors",
        key="--data-path needs --tokenizer-type"),
    Bad("a --split that leaves nothing for training", "leaves nothing for training",
        "give the training split a share",
        "tests/test_data_training.py::test_bad_data_flags_are_one_line_errors"),
    Bad("a --data-path weight list with a weight missing", "--data-path: '0.5' looks like a "
        "weight, but weights must come one before each prefix (e.g. 0.3 A 0.7 B)",
        "write weight prefix pairs: 0.3 A 0.7 B",
        "tests/test_data_training.py::test_bad_data_flags_are_one_line_errors",
        "'0.5' looks like a weight"),
    Bad("negative --data-path weights", "--data-path: weights must be finite and "
        "non-negative, got [-1.0, 2.0]", "use weights >= 0",
        "tests/test_blending.py::test_parse_blend_reads_megatron_data_paths", "non-negative"),
    Bad("--data-path weights that sum to zero", "--data-path: the weights sum to zero",
        "give some dataset a positive weight",
        "tests/test_blending.py::test_parse_blend_reads_megatron_data_paths", "zero"),
    Bad("--data-cache-path that is a file", "exists and is not a directory",
        "point it at a directory", "tests/test_data_training.py::"
        "test_bad_data_flags_are_one_line_errors"),
    Bad("--data-path with --mock-data", "--mock-data cannot be combined with --data-path or "
        "--train-data-path", "keep one data source", "tests/test_data_training.py::"
        "test_bad_data_flags_are_one_line_errors", key="cannot be combined"),
    Bad("--data-path with --train-data-path", "--data-path and --train-data-path cannot be "
        "combined: use --data-path with --split, or --train-data-path (with --valid-data-path, "
        "--test-data-path)", "keep one of them", "tests/test_data_training.py::"
        "test_bad_data_flags_are_one_line_errors",
        key="--data-path and --train-data-path cannot be combined"),
    Bad("a missing --tokenizer-model", "--tokenizer-model", "fix the path: every tokenizer is "
        "read from local files, nothing is downloaded",
        "tests/test_tokenizers.py::test_missing_and_broken_files_are_named"),
    Bad("a --tokenizer-model that is not a SentencePiece model", "not a SentencePiece model",
        "pass the .model file train_tokenizer.py wrote",
        "tests/test_tokenizers.py::test_missing_and_broken_files_are_named"),
    Bad("a missing --merge-file", "--merge-file", "GPT-2 BPE needs both --vocab-file and "
        "--merge-file", "tests/test_tokenizers.py::test_missing_and_broken_files_are_named"),
    Bad("a vocab.json that is not JSON", "not a JSON vocabulary", "pass GPT-2's vocab.json",
        "tests/test_tokenizers.py::test_missing_and_broken_files_are_named"),
    Bad("a merges.txt line without two symbols", "expected two symbols",
        "pass GPT-2's merges.txt", "tests/test_tokenizers.py::"
        "test_missing_and_broken_files_are_named"),
    Bad("a HuggingFace tokenizer directory without tokenizer.json", "has no tokenizer.json",
        "point --tokenizer-model at tokenizer.json or its directory",
        "tests/test_tokenizers.py::test_missing_and_broken_files_are_named"),
    Bad("an unknown --tokenizer-type", "'BertTokenizer' is not one of",
        "use a type the line lists", "tests/test_tokenizers.py::"
        "test_missing_and_broken_files_are_named"),
    Bad("a SentencePiece model without an eos piece where an eod is needed", "has no eos piece",
        "train the tokenizer with an eos piece (train_tokenizer.py does), or drop "
        "--append-eod / --eod-mask-loss", "tests/test_tokenizers.py::"
        "test_sentencepiece_without_eos_has_no_eod"),
    Bad("an .idx with a wrong magic, version, dtype code, counts, lengths, document indices, or "
        "pointers past the end of the .bin", "not a Megatron .idx file: magic",
        "regenerate the dataset with tools/preprocess_data.py (the line names the offset)",
        "tests/test_indexed_dataset.py::test_each_malformed_idx_is_named"),
    Bad("a truncated or over-long .bin, a missing .bin", "truncated: sequence 4 ends at byte 30",
        "the .bin does not match its .idx: copy both again, or regenerate",
        "tests/test_indexed_dataset.py::test_bin_problems_and_missing_files_are_named"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid 4-document dataset of uint16 tokens."""
    prefix = str(tmp_path_factory.mktemp("data") / "tiny")
    with IndexedDatasetBuilder(prefix, "uint16") as builder:
        for n in (40, 50, 60, 70):
            builder.add_item(list(range(n)))
            builder.end_document()
    return prefix


def _copy_dataset(prefix: str, directory: Path, name: str) -> str:
    out = str(directory / name)
    for ext in ("bin", "idx"):
        Path(f"{out}.{ext}").write_bytes(Path(f"{prefix}.{ext}").read_bytes())
    return out


def _truncated_bin(prefix: str, directory: Path) -> list[str]:
    out = _copy_dataset(prefix, directory, "cut")
    os.truncate(f"{out}.bin", os.path.getsize(f"{out}.bin") - 3)
    return ["--data-path", out]


def _wrong_magic(prefix: str, directory: Path) -> list[str]:
    out = _copy_dataset(prefix, directory, "magic")
    data = bytearray(Path(f"{out}.idx").read_bytes())
    data[:9] = b"NOTMMIDX\x00"
    Path(f"{out}.idx").write_bytes(bytes(data))
    return ["--data-path", out]


def _weights(words: str) -> Callable[[str, Path], list[str]]:
    return lambda prefix, _: ["--data-path", *words.replace("P", prefix).split()]


DATA_CASES: list[tuple[Bad, Callable[[str, Path], list[str]]]] = [
    (B("a truncated .bin behind --data-path", ".bin: truncated: sequence 3 ends at byte 440",
       "the .bin does not match its .idx: copy both again, or regenerate"), _truncated_bin),
    (B("an .idx with a wrong magic behind --data-path", ".idx: not a Megatron .idx file: magic",
       "regenerate the dataset with tools/preprocess_data.py"), _wrong_magic),
    (B("a --data-path weight that is not finite", "--data-path: weights must be finite and "
       "non-negative, got [nan, 1.0]", "use finite weights >= 0"), _weights("nan P 1 P")),
    (B("a missing --vocab-file", "--vocab-file /nonexistent/vocab.json: no such file",
       "fix the path (GPT-2 BPE needs both --vocab-file and --merge-file)"),
     lambda prefix, _: ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", "/nonexistent/vocab.json", "--merge-file",
                        "/nonexistent/merges.txt"]),
]  # fmt: skip


@pytest.mark.parametrize("case", DATA_CASES, ids=_flag_id)
def test_bad_data_behind_the_flags(case, tiny_prefix: str, tmp_path: Path) -> None:
    bad, make = case
    extra = make(tiny_prefix, tmp_path)
    tokenizer = [] if "--tokenizer-type" in extra else NULL_TOKENIZER
    message = flag_error({"mock_data": None, "vocab_size": None, "eval_iters": 0}, extra +
                         tokenizer, 1)  # fmt: skip
    assert bad.says in message, (bad.says, message)


# --- JSONL input to tools/preprocess_data.py -------------------------------------------------

ELSEWHERE_JSONL = [
    Bad("a malformed JSON line under --strict", ":2: malformed JSON: Expecting value at column 1 "
        "(--strict)", "fix or drop that line (without --strict bad lines are skipped and "
        "counted)", "tests/test_preprocess.py::test_strict_fails_on_the_first_bad_line_and_"
        "writes_nothing"),
    Bad("bad lines without --strict: malformed JSON, empty document, missing key, invalid UTF-8, "
        "blank line, not a JSON object, not a string", "skipped 7 of 14 lines: ",
        "a warning, not an error: the lines named were skipped; --strict makes the first fatal",
        "tests/test_preprocess.py::test_bad_lines_are_skipped_and_reported_by_line"),
    Bad("an input with no usable document", "no usable documents; ",
        "check --json-keys against the input's keys", "tests/test_preprocess.py::"
        "test_missing_input_and_output_directory_are_named"),
    Bad("a missing --input", "no such input file", "fix the path",
        "tests/test_preprocess.py::test_missing_input_and_output_directory_are_named"),
    Bad("--output-prefix in a directory that does not exist", "--output-prefix",
        "create the directory first", "tests/test_preprocess.py::"
        "test_missing_input_and_output_directory_are_named"),
]  # fmt: skip

GOOD = b'{"text": "1 2 3"}\n'
JSONL_CASES: list[tuple[Bad, bytes, list[str]]] = [
    (B("a non-UTF-8 line under --strict", ":2: invalid UTF-8: byte offset 10 in the line "
       "(--strict)", "re-encode the file as UTF-8, or drop --strict to skip the line"),
     GOOD + b'{"text": "\xff 1"}\n', ["--strict"]),
    (B("an empty document under --strict", ':2: empty document: \'text\' has no tokens (--strict)',
       "drop empty records, or drop --strict to skip them"),
     GOOD + b'{"text": ""}\n', ["--strict"]),
    (B("a line the tokenizer cannot encode under --strict", ":1: tokenizer error: 'text': ",
       "check the tokenizer flags match the data"), b'{"text": "1 x"}\n' + GOOD, ["--strict"]),
    (B("a record over the line-length limit under --strict", ":2: line too long: 43 bytes, over "
       "the limit of 32 (--strict)", "split the record (the limit, 1 GiB by default, keeps "
       "documents within the .idx's int32 lengths), or drop --strict to skip it"),
     GOOD + b'{"text": "' + b"1 " * 15 + b'"}\n', ["--strict", "--max-line-bytes", "32"]),
    (B("an empty input file", "no usable documents; ", "the file is empty: check --input"),
     b"", []),
    (B("an input of blank lines only", "no usable documents; ", "check --input"), b"\n\n\n", []),
    (B("--workers 0", "--workers must be at least 1, got 0", "use 1 or more"), GOOD,
     ["--workers", "0"]),
    (B("a directory as --input", "is a directory, not an input file", "pass the .jsonl file"),
     b"DIRECTORY", []),
]  # fmt: skip


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` (hidden ones too) -> sha256 of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _preprocess_argv(source: Path, out: Path, *extra: str) -> list[str]:
    return ["--input", str(source), "--output-prefix", str(out / "o"), "--quiet",
            *NULL_TOKENIZER, *extra]  # fmt: skip


def _previous_output(out: Path) -> None:
    """An earlier run's output under the same prefix, which a failed run must leave intact."""
    out.mkdir()
    (out / "o_text_document.bin").write_bytes(b"earlier bin")
    (out / "o_text_document.idx").write_bytes(b"earlier idx")


@pytest.mark.parametrize("case", JSONL_CASES, ids=_flag_id)
def test_bad_jsonl(case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, content, extra = case
    source = tmp_path / "in.jsonl"
    if content == b"DIRECTORY":
        source.mkdir()
    else:
        source.write_bytes(content)
    out = tmp_path / "out"
    _previous_output(out)
    before = snapshot(tmp_path)
    assert (
        run_tool(preprocess_data.PROG, preprocess_data.main, _preprocess_argv(source, out, *extra))
        == 1
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("preprocess_data.py: error: "), lines
    assert bad.says in one_line(lines[0]), (bad.says, lines[0])
    assert snapshot(tmp_path) == before  # no output, no temporary file, the old output intact


def test_overlong_records_are_skipped_and_counted(tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(GOOD + b'{"text": "' + b"7 " * 40 + b'"}\n' + GOOD + b"9" * 100)
    argv = _preprocess_argv(source, tmp_path, "--max-line-bytes", "32")
    assert run_tool(preprocess_data.PROG, preprocess_data.main, argv) == 0
    warning = capsys.readouterr().err.strip()
    assert warning == (f"preprocess_data.py: warning: {source}: skipped 2 of 4 lines: 2 line too "
                       "long (lines 2, 4)")  # fmt: skip
    from megapipe.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == [[1, 2, 3]] * 2


def test_bad_tool_flags_are_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        preprocess_data.main(["--input", str(tmp_path / "x"), "--workers", "two"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["preprocess_data.py: error: argument --workers: invalid int value: 'two' "
                     "(see --help)"]  # fmt: skip
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("tool", "argv", "status", "line"),
    [
        (
            "generate_text",
            ["--load", "x", "--top-k", "many"],
            2,
            "generate_text.py: error: argument --top-k: invalid int value: 'many' (see --help)",
        ),
        (
            "run_text_generation_server",
            ["--port", "eighty"],
            2,
            "run_text_generation_server.py: "
            "error: argument --port: invalid int value: 'eighty' (see --help)",
        ),
        (
            "plot_schedule",
            ["--output", "x.png", "--schedule", "1f1b", "--pp", "0"],
            1,
            "plot_schedule.py: error: pipeline size (0), virtual stages (1) and micro-batches (8) "
            "must all be positive",
        ),
    ],
)
def test_the_inference_and_plot_tools_fail_in_one_line(tool, argv, status, line, capsys) -> None:
    """--debug prints the traceback above the same line."""
    module = importlib.import_module(tool)
    for debug in ([], ["--debug"]):
        try:
            code = module.main(argv + debug)
        except SystemExit as exit_:
            code = exit_.code
        assert code == status
        captured = capsys.readouterr()
        lines = (captured.err or captured.out).strip().splitlines()
        assert lines[-1] == line
        assert len(lines) == 1 or (debug and "Traceback" in lines[0] and status == 1)


# --- checkpoints ----------------------------------------------------------------------------

ELSEWHERE_CHECKPOINTS = [
    Bad("an MoE model exported to Hugging Face with what MixtralForCausalLM cannot hold (shared "
        "experts, sigmoid or pre-softmax routing, a top-k scaling factor, --moe-layer-freq other "
        "than 1, biases, a capacity factor)", "--moe-shared-expert-intermediate-size has no "
        "Hugging Face equivalent: MixtralForCausalLM has no shared expert", "export only "
        "Mixtral-shaped MoE models (softmax top-k on every layer, no biases); keep the megapipe "
        "checkpoint for the others", "tests/test_mixtral_hf.py::"
        "test_what_mixtral_cannot_hold_is_refused", key="has no Hugging Face equivalent"),
    Bad("a Megatron-LM MoE checkpoint with add_bias_linear (Megatron-Core's router bias) or in "
        "the legacy torch format", "with add_bias_linear (a bias on the MoE router, which "
        "megapipe's router lacks) is a model megapipe cannot build yet", "read MoE checkpoints "
        "of runs with --disable-bias-linear, saved as torch_dist",
        "tests/test_moe_megatron_core_checkpoint.py::"
        "test_moe_checkpoints_move_between_megatron_core_and_megapipe",
        key="router, which megapipe's router lacks"),
    Bad("a Mixtral config.json with what megapipe lacks (sliding_window, router_jitter_noise, "
        "num_experts_per_tok 1)", "sliding_window 8: megapipe's attention is full",
        "import Mixtral models with full attention, no router jitter and top-k of 2 or more",
        "tests/test_mixtral_hf.py::test_a_mixtral_megapipe_cannot_run_is_refused"),
    Bad("a truncated shard (torch_dist)", "bytes, ", "the file was damaged after saving: load "
        "an earlier iteration with --ckpt-step N", "tests/test_torch_dist.py::"
        "test_checksum_failures_name_the_file"),
    Bad("a bit-flipped shard, .metadata or common.pt (torch_dist)", "differs",
        "the file was damaged after saving: load an earlier iteration with --ckpt-step N",
        "tests/test_torch_dist.py::test_checksum_failures_name_the_file"),
    Bad("a missing shard or checksums.json (torch_dist)", "missing",
        "copy the whole iteration directory again", "tests/test_torch_dist.py::"
        "test_checksum_failures_name_the_file"),
    Bad("a .metadata that carries pickled code", "refused to unpickle posix.system",
        "do not load it: the checkpoint was tampered with",
        "tests/test_torch_dist.py::test_malicious_metadata_pickle_is_refused"),
    Bad("a common.pt that carries pickled code", "refused by weights_only",
        "do not load it: the checkpoint was tampered with",
        "tests/test_torch_dist.py::test_malicious_common_pickle_is_refused"),
    Bad("a checkpoint of another shape", "has global shape (8, 4) in the checkpoint, (16, 4) "
        "in this model", "use the architecture flags of the run that saved it (the parallel "
        "layout may differ)", "tests/test_torch_dist.py::"
        "test_missing_key_and_shape_mismatch_raise_on_every_rank"),
    Bad("a checkpoint missing a tensor this model has", "is missing",
        "use the architecture flags of the run that saved it",
        "tests/test_torch_dist.py::test_missing_key_and_shape_mismatch_raise_on_every_rank"),
    Bad("a legacy (--ckpt-format torch) checkpoint at another TP/PP layout",
        "saved at TP 2 x PP 1", "load at the saved layout, or rewrite it with "
        "tools/checkpoint/convert.py", "tests/test_legacy_torch.py::"
        "test_legacy_checkpoint_at_another_layout_is_refused"),
    Bad("a corrupt shard read by one rank of several", "(corrupted)", "every rank stops with "
        "the same line; load an earlier iteration", "tests/test_checkpoint_resume.py::"
        "test_a_corrupt_checkpoint_stops_every_rank_with_one_line"),
    Bad("a resumed run whose LR schedule differs from the checkpoint's (e.g. another "
        "--train-iters)", "the learning-rate schedule differs from the one checkpoint",
        "add --use-checkpoint-opt_param-scheduler to continue the saved schedule, or "
        "--override-opt_param-scheduler to follow the command line's (or restore the flags)",
        "tests/test_lr_scheduler_rule.py::"
        "test_a_changed_schedule_is_refused_then_overridden_or_continued",
        key="add --override-opt_param-scheduler to follow the command line's"),
    Bad("--use-checkpoint-opt_param-scheduler for a --decoupled-lr checkpoint without "
        "--decoupled-lr", "gives the embedding and output layer --decoupled-lr",
        "add --decoupled-lr (its value is taken from the checkpoint)",
        "tests/test_lr_scheduler_rule.py::test_the_rule_picks_the_command_line_or_the_checkpoint"),
    Bad("a checkpoint whose vocabulary tensors have fewer rows than the model's vocabulary",
        "vocabulary rows, fewer than this model's vocabulary of", "use the tokenizer (or "
        "--vocab-size) of the run that saved it", "tests/test_checkpoint_padding.py::"
        "test_too_few_vocabulary_rows_are_refused_in_one_line"),
]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny torch_dist checkpoint (one process) and a legacy per-rank file with checksums."""
    root = tmp_path_factory.mktemp("ckpt")
    dist_dir = root / "iter_0000001"
    shard = TensorShard(torch.arange(12.0).reshape(3, 4), (0, 0), (3, 4))
    save_sharded(str(dist_dir), {"w": [shard]}, {"iteration": 1}, group=None, coordinator=True)
    legacy = root / "mp_rank_00"
    legacy.mkdir()
    torch.save({"iteration": 1, "model": {"w": torch.arange(12.0)}}, legacy / "model_optim_rng.pt")
    atomic_dir.write_checksums(
        str(legacy), atomic_dir.fsync_and_digest(str(legacy), ["model_optim_rng.pt"])
    )
    return {"dist": dist_dir, "legacy": legacy}  # fmt: skip


def _cut(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(os.path.getsize(path) * keep))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign(directory: Path) -> None:
    """No checksums.json, as a Megatron-Core checkpoint: only the safe readers stand guard."""
    os.unlink(directory / atomic_dir.CHECKSUMS_NAME)


def _load_dist(directory: Path) -> None:
    destination = {"w": [TensorShard(torch.zeros(3, 4), (0, 0), (3, 4))]}
    load_sharded(str(directory), destination, group=None, require_checksums=False)
    load_common(str(directory), require_checksums=False)


def _load_legacy(directory: Path) -> None:
    read_verified(str(directory), "model_optim_rng.pt")


def _load_legacy_unverified(directory: Path) -> None:
    read_file(str(directory / "model_optim_rng.pt"))


def _evil_legacy(directory: Path) -> None:
    torch.save({"iteration": 1, "x": Evil(str(directory.parent / "pwned"))},
               directory / "model_optim_rng.pt")  # fmt: skip
    refresh_checksums(directory)


CHECKPOINT_CASES: list[tuple[Bad, str, Callable[[Path], None], Callable[[Path], None]]] = [
    (B("a truncated .metadata in a checkpoint without checksums.json (e.g. Megatron-Core's)",
       ".metadata: not a readable DCP metadata file", "copy the checkpoint again"), "dist",
     lambda d: (_foreign(d), _cut(d / ".metadata")), _load_dist),
    (B("a truncated common.pt in a checkpoint without checksums.json", "common.pt: not a "
       "readable torch file (truncated or corrupted", "copy the checkpoint again"), "dist",
     lambda d: (_foreign(d), _cut(d / "common.pt")), lambda d: load_common(
         str(d), require_checksums=False)),
    (B("a malformed metadata.json", "metadata.json: malformed", "copy the checkpoint again"),
     "dist", lambda d: (d / "metadata.json").write_text("{not json"), _load_dist),
    (B("a metadata.json of another sharded backend", "sharded_backend is 'zarr', not "
       "'torch_dist'", "convert it to torch_dist with Megatron-Core first"), "dist",
     lambda d: (d / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"})),
     _load_dist),
    (B("a truncated legacy checkpoint file", "model_optim_rng.pt: ", "load an earlier "
       "iteration with --ckpt-step N"), "legacy", lambda d: _cut(d / "model_optim_rng.pt"),
     _load_legacy),
    (B("a bit-flipped legacy checkpoint file", "differs from the saved", "load an earlier "
       "iteration with --ckpt-step N"), "legacy", lambda d: _flip(d / "model_optim_rng.pt"),
     _load_legacy),
    (B("a truncated legacy file without checksums.json (e.g. Megatron-LM's)", "not a readable "
       "torch file (truncated or corrupted: PytorchStreamReader failed reading zip archive",
       "copy the checkpoint again"), "legacy",
     lambda d: (_foreign(d), _cut(d / "model_optim_rng.pt")), _load_legacy_unverified),
    (B("a legacy checkpoint file that carries pickled code", "refused by weights_only loading: "
       "it needs posix.system, which is not a tensor or plain python type (the file may carry "
       "code)", "do not load it: the checkpoint was tampered with"), "legacy", _evil_legacy,
     _load_legacy),
]  # fmt: skip


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=_flag_id)
def test_bad_checkpoints(case, saved: dict[str, Path], tmp_path: Path) -> None:
    bad, kind, damage, load = case
    directory = tmp_path / saved[kind].name
    shutil.copytree(saved[kind], directory)
    damage(directory)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load(directory)
    assert bad.says in one_line(str(info.value)), (bad.says, str(info.value))
    assert str(directory) in str(info.value)
    assert snapshot(tmp_path) == before  # nothing written, nothing run ("pwned" not created)


TRACKER_CASES = [
    (B("a tracker file that is not a number", "--load: tracker file ", "write the iteration "
       "number into latest_checkpointed_iteration.txt (or delete it to start from scratch)"),
     "abc"),
    (B("a Megatron 'release' tracker without its release/ folder", "latest_checkpointed_"
       "iteration.txt names release, but ", "copy the release/ folder beside the tracker, or "
       "fix the tracker"), "release"),
    (B("a tracker that names an iteration that is not there", "latest_checkpointed_iteration.txt "
       "names iteration 5, but ", "the iteration directory was deleted or not copied: "
       "restore it, or fix the tracker"), "5"),
]  # fmt: skip


@pytest.mark.parametrize("case", TRACKER_CASES, ids=_flag_id)
def test_bad_trackers(case, tmp_path: Path) -> None:
    bad, text = case
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
    message = flag_error({"load": str(tmp_path)}, [], 1)
    assert bad.says in message, (bad.says, message)


# --- each command-line program once, as a subprocess ------------------------------------------


def _env() -> dict[str, str]:
    return {k: v for k, v in pretrain_env().items() if k != "MEGAPIPE_DEBUG"}


@dataclass
class Program:
    """A command-line run that must fail with one line: the line, its status, what it wrote."""

    argv: list[str]
    says: str
    status: int
    watched: Path  # must be unchanged (or absent) afterwards
    main: Callable[[list[str]], int]  # the same program in process


def _convert_main(args: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(
        "convert_tool", ROOT / "tools/checkpoint/convert.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(args)


def _pretrain_main(args: list[str]) -> int:
    import pretrain_gpt

    return pretrain_gpt.main(args)


SCRIPTS = {
    "pretrain_gpt.py": ROOT / "pretrain_gpt.py",
    "preprocess_data.py": ROOT / "tools" / "preprocess_data.py",
    "convert.py": ROOT / "tools" / "checkpoint" / "convert.py",
}


def _programs(root: Path) -> dict[str, Program]:
    """Each program with a bad input, and a previous output it must leave alone."""
    save = root / "save"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("abc")  # a previous run's output
    source = root / "in.jsonl"
    source.write_bytes(GOOD + b"not json\n")
    out = root / "out"
    _previous_output(out)
    broken = root / "broken"
    (broken / "iter_0000001").mkdir(parents=True)
    (broken / "latest_checkpointed_iteration.txt").write_text("1")
    converted = root / "converted"
    return {
        "pretrain_gpt.py": Program(
            [*argv(hidden_size=100, num_attention_heads=3), "--save", str(save)],
            "pretrain_gpt.py: error: --hidden-size (100) must be divisible by "
            "--num-attention-heads (3)", 2, save, _pretrain_main),
        "preprocess_data.py": Program(
            _preprocess_argv(source, out, "--strict"),
            f"preprocess_data.py: error: {source}:2: malformed JSON", 1, out,
            lambda args: run_tool(preprocess_data.PROG, preprocess_data.main, args)),
        "convert.py": Program(
            ["--model-type", "GPT", "--load-dir", str(broken), "--save-dir", str(converted)],
            f"convert.py: error: checkpoint file {broken}/iter_0000001/checksums.json: missing",
            2, converted,
            _convert_main),
    }  # fmt: skip


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each program run once as a subprocess, all started at once."""
    cases = _programs(tmp_path_factory.mktemp("cli"))
    before = {name: snapshot(case.watched) for name, case in cases.items()}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPTS[name]), *case.argv], env=_env(), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, case in cases.items()
    }  # fmt: skip
    done = {name: (*proc.communicate(timeout=120), proc.returncode) for name, proc in procs.items()}
    return {"cases": cases, "before": before, "done": done}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_program_fails_with_one_line_and_writes_nothing(programs, name: str) -> None:
    case: Program = programs["cases"][name]
    stdout, stderr, status = programs["done"][name]
    assert status == case.status, stderr
    assert len(stderr.splitlines()) == 1 and stderr.startswith(case.says), stderr
    one_line(stderr.strip())
    assert "Traceback" not in stdout
    assert snapshot(case.watched) == programs["before"][name]  # intact (or still absent)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_debug_shows_the_traceback_above_the_same_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAPIPE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    case = _programs(tmp_path)[name]
    assert case.main(case.argv) == case.status
    plain = capsys.readouterr().err
    assert case.main([*case.argv, "--debug"]) == case.status
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == plain.strip()
    assert any(str(ROOT / "megapipe") in line for line in lines)  # where megapipe raised it
    monkeypatch.setenv("MEGAPIPE_DEBUG", "1")
    assert case.main(case.argv) == case.status
    assert capsys.readouterr().err.splitlines() == lines


# --- the catalogue itself ---------------------------------------------------------------------

ELSEWHERE = ELSEWHERE_FLAGS + ELSEWHERE_DATA + ELSEWHERE_JSONL + ELSEWHERE_CHECKPOINTS
CLI_ROWS = [
    Bad(
        "any of the above from a command-line program",
        "PROG: error: ",
        "one line on stderr; pretrain_gpt.py exits 2 for flags (every rank alike, before any "
        "process group) and 1 for data, checkpoint or NaN errors found later; tools exit 1 (2 for "
        "their flags); add --debug (or MEGAPIPE_DEBUG=1) to see the traceback",
    ),
]
CATALOGUE: dict[str, list[Bad]] = {
    "flags": [case[0] for case in FLAG_CASES] + ELSEWHERE_FLAGS,
    "data and tokenizer files": [case[0] for case in DATA_CASES] + ELSEWHERE_DATA,
    "JSONL input": [case[0] for case in JSONL_CASES] + ELSEWHERE_JSONL,
    "checkpoints": [case[0] for case in CHECKPOINT_CASES + TRACKER_CASES] + ELSEWHERE_CHECKPOINTS,
    "programs": CLI_ROWS,
}


@functools.cache
def _test_module(path: str) -> tuple[dict[str, str], str]:
    """A test module's functions -> the string constants in each; all its string constants."""
    tree = ast.parse((ROOT / path).read_text())

    def strings(node: ast.AST) -> str:
        found = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
        return " ".join(v for v in found if isinstance(v, str)).replace("\\", "")

    functions = {n.name: strings(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return functions, strings(tree)


@pytest.mark.parametrize("bad", ELSEWHERE, ids=lambda bad: bad.what)
def test_rows_tested_elsewhere_name_a_test_that_checks_the_message(bad: Bad) -> None:
    path, name = bad.tested.split("::")
    functions, module = _test_module(path)
    assert name in functions, f"{bad.tested} does not exist"
    fragment = bad.key or bad.says  # in the test itself, or in a table of cases it reads
    assert fragment in functions[name] or fragment in module, f"{path} never says {fragment!r}"


# Where the flags are refused: every rejection site in these modules must have a catalogue row.
SITE_FILES = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megapipe" / "arguments").glob("*.py")),
    "megapipe/training/lr_schedule.py", "megapipe/training/batch_size.py",
    "megapipe/pipeline/partition.py", "megapipe/pipeline/schedules.py",
    "megapipe/checkpointing/checkpointer.py", "megapipe/checkpointing/tracker.py",
    "megapipe/checkpointing/scheduler_rule.py",
    "megapipe/data/splits.py", "megapipe/data/blending.py",
]  # fmt: skip
# Sites no flag can reach (a check above them refuses first, or only a library caller can).
UNREACHABLE = {
    "MoE layers are local only yet": "TransformerEngine is not installed here: --transformer-impl "
    "transformer_engine is refused first",
    "--fp8-format with --recompute-granularity": "megatron_compat.py still refuses --fp8-format",
    "--lr is required": "argparse requires --lr first",
    "--lr-decay-iters or --train-iters is required": "--train-iters is always set by then",
    "--lr-decay-iters defaults to --train-iters, which must be positive": "validate_training",
    "--global-batch-size must be positive, got": "validate_training checks it first",
    "pipeline size (": "validate_parallel and the batch checks come first",
    "virtual pipeline stages need --pipeline-model-parallel-size > 1 (with": "validate_pipeline",
    "is outside a pipeline of": "a library caller's rank",
    "a blend needs 1..32767 datasets": "32768 --data-path prefixes",
    "samples of dataset": "found while building the blend (DataError, one line, exit 1)",
}


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _literals(node.left) + _literals(node.right)
    return []


def rejection_sites(path: str) -> list[tuple[int, list[str]]]:
    """(line, the literal pieces of its message) for every refusal in `path`: `raise
    ConfigError/DataError(...)`, `_require(cond, message)`, `_positive(name=...)`,
    `_divisible((flag, n), (flag, d))`. Messages built elsewhere (no literal) are left out."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not isinstance(node, (ast.Raise, ast.Call)):
            continue
        call = node.exc if isinstance(node, ast.Raise) else node
        name = getattr(getattr(call, "func", None), "id", "")
        if isinstance(node, ast.Raise) and name in ("ConfigError", "DataError") and call.args:
            pieces = _literals(call.args[0])
        elif isinstance(node, ast.Call) and name == "_require" and len(call.args) == 2:
            pieces = _literals(call.args[1])
        elif isinstance(node, ast.Call) and name == "_positive":
            for keyword in (k for k in call.keywords if k.arg):  # not **{name: value}
                found.append((node.lineno, [f"{flag(keyword.arg)} must be positive"]))
            continue
        elif isinstance(node, ast.Call) and name == "_divisible":
            (a, _), (b, _) = (arg.elts for arg in call.args)
            pieces = [f"{a.value} (", f"must be divisible by {b.value} ("]
        else:
            continue
        pieces = [piece.strip() for piece in pieces if len(piece.strip()) >= 6]
        if pieces:
            found.append((node.lineno, pieces))
    return found


def _covered(pieces: list[str], messages: list[str]) -> bool:
    if len(pieces) == 2 and pieces[1].startswith("must be divisible by"):  # both flags named
        return any(all(piece in m for piece in pieces) for m in messages)
    return any(p in m or (len(m) >= 20 and m in p) for p in pieces for m in messages)


def test_every_rejection_site_of_the_flags_has_a_row() -> None:
    messages = [text for rows in CATALOGUE.values() for bad in rows
                for text in (bad.says, bad.key) if text]  # fmt: skip
    missing = [
        f"{path}:{line}: {pieces[0]!r}"
        for path in SITE_FILES
        for line, pieces in rejection_sites(path)
        if not _covered(pieces, messages)
        and not any(key in piece for key in UNREACHABLE for piece in pieces)
    ]
    assert not missing, "refusals without a catalogue row:\n" + "\n".join(missing)


def test_every_row_is_described_once() -> None:
    rows = [bad for group in CATALOGUE.values() for bad in group]
    assert len({(bad.what, bad.says) for bad in rows}) == len(rows)
    assert all(bad.what and bad.says and bad.fix for bad in rows)


def troubleshooting_table() -> str:
    """The catalogue as troubleshooting rows (`| you see | what to do |`), one table per kind
    of input (docs/troubleshooting.md is rendered by tools/gen_troubleshooting.py)."""
    out = []
    for group, rows in CATALOGUE.items():
        out += [f"**{group}**", "", "| you see | what to do |", "|---|---|"]
        for bad in rows:
            says = bad.says.replace("|", "\\|")
            out.append(f"| `{says}` ({bad.what}) | {bad.fix} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(troubleshooting_table())
