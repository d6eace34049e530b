"""Rewrite a megapipe or Megatron-LM checkpoint for another tensor/pipeline layout and format,
or as a Hugging Face model (Megatron's `tools/checkpoint/convert.py` flags). Model weights only:
the optimizer state is dropped.

    python tools/checkpoint/convert.py --model-type GPT --loader megapipe --saver megapipe \\
        --load-dir A --save-dir B --target-tensor-parallel-size 2 \\
        --target-pipeline-model-parallel-size 4 [--target-ckpt-format torch|torch_dist]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megapipe.arguments.validation import validate_model  # noqa: E402
from megapipe.checkpointing.hf_safetensors import DEFAULT_MAX_SHARD_SIZE  # noqa: E402
from megapipe.conversion.hf_export import export_hf  # noqa: E402
from megapipe.conversion.hf_import import import_hf  # noqa: E402
from megapipe.conversion.megatron_lm_source import convert_any  # noqa: E402
from megapipe.data.tool_cli import OneLineParser  # noqa: E402
from megapipe.errors import run_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="tools/checkpoint/convert.py",
        description="Convert a megapipe or Megatron-LM checkpoint (torch_dist or Megatron's "
        "legacy torch layout, any TP/PP) to another TP/PP layout and format, or to Hugging Face "
        "(--saver hf), in one process. MODEL WEIGHTS ONLY, as "
        "Megatron's converter: the optimizer and random states are dropped (continue with "
        "--no-load-optim); the iteration and sample counts are kept.",
    )
    parser.add_argument("--model-type", required=True, choices=["GPT"])
    parser.add_argument(
        "--loader",
        default="megapipe",
        choices=["megapipe", "mcore", "legacy", "hf"],
        help="megapipe (or Megatron's names mcore, legacy): --load-dir is a checkpoint that "
        "megapipe or Megatron-LM wrote, torch_dist or legacy torch, any TP/PP (which of them is "
        "read from the files). hf: --load-dir is a transformers GPT-2, Llama or Mixtral directory "
        "(config.json + safetensors), written as a megapipe checkpoint at the target layout "
        "(iteration 0).",
    )
    parser.add_argument(
        "--saver",
        default="megapipe",
        choices=["megapipe", "hf"],
        help="hf: write a transformers directory (config.json, model.safetensors or shards "
        "with an index, the run's tokenizer files) that AutoModelForCausalLM.from_pretrained "
        "loads (GPT2LMHeadModel, LlamaForCausalLM, or MixtralForCausalLM for --num-experts).",
    )
    parser.add_argument(
        "--load-dir", required=True, help="Checkpoint directory to read (its tracker's iteration)."
    )
    parser.add_argument(
        "--save-dir", required=True, help="Directory to write the converted checkpoint to."
    )
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument(
        "--target-ckpt-format",
        default="torch_dist",
        choices=["torch_dist", "torch"],
        help="torch_dist (layout-free) or torch (Megatron's legacy per-rank files). "
        "Default: torch_dist.",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="--saver hf: split the weights into shards of at most this size, with an index "
        "(a tensor above it gets a shard of its own): 5GB, 500MB, 2000000 (bytes). "
        f"Default: {DEFAULT_MAX_SHARD_SIZE}, as transformers' save_pretrained.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Convert; a bad checkpoint or layout (any megapipe error, or an OSError) is one line on
    stderr and exit status 2 (`--debug`: the traceback first)."""
    return run_cli("convert.py", _run, argv, status=2, also=(OSError,))


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.loader == "hf" and args.saver == "hf":
        print("convert.py: error: --loader hf with --saver hf: nothing to convert", file=sys.stderr)
        return 2
    if args.saver == "hf":
        export_hf(args.load_dir, args.save_dir, max_shard_size=args.max_shard_size)
        return 0
    if args.loader == "hf":
        import_hf(
            args.load_dir,
            args.save_dir,
            args.target_tensor_parallel_size,
            args.target_pipeline_model_parallel_size,
            args.target_ckpt_format,
            validate=validate_model,
        )
        return 0
    convert_any(
        args.load_dir,
        args.save_dir,
        args.target_tensor_parallel_size,
        args.target_pipeline_model_parallel_size,
        args.target_ckpt_format,
    )
    print("note: model weights only; the optimizer state was dropped (load with --no-load-optim)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
