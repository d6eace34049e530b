"""The one place training and evaluation ask for their data: a batch source per split
(train, valid, test) for --mock-data or real datasets."""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import Configs, DataConfig
from megapipe.data.config_check import data_split_source, data_tokenizer
from megapipe.data.gpt_batches import GPTBatchSource
from megapipe.data.gpt_builder import build_split_dataset
from megapipe.data.index_cache import BuildContext
from megapipe.data.masks import MaskOptions
from megapipe.data.mock import MockGPTDataset
from megapipe.data.splits import SPLIT_NAMES, parse_split

BatchSource = MockGPTDataset | GPTBatchSource  # both: .batch(range) -> TrainingBatch, stateless


@dataclass(frozen=True)
class BatchSources:
    """One batch source per split; valid/test are None when there is nothing to evaluate on
    (zero samples asked for, a zero share of --split, or no --valid/--test-data-path)."""

    train: BatchSource
    valid: BatchSource | None
    test: BatchSource | None


def _masks(data: DataConfig, context_parallel_size: int = 1) -> MaskOptions:
    """Context parallelism takes --reset-attention-mask as per-token document ids."""
    tokenizer = data_tokenizer(data)
    needs_eod = data.eod_mask_loss or data.reset_position_ids or data.reset_attention_mask
    return MaskOptions(
        eod=tokenizer.eod if needs_eod else -1,
        eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        document_ids=context_parallel_size > 1,
    )


def _mock_has_split(data: DataConfig, name: str) -> bool:
    """Mock data follows --split's shares as Megatron's mock datasets do: no share, no split."""
    return name == "train" or parse_split(data.split)[SPLIT_NAMES.index(name)] > 0


def build_batch_sources(
    configs: Configs, *, train_samples: int, valid_samples: int, test_samples: int
) -> BatchSources:
    """Mock samples, or each split of --data-path (with --split) / --{train,valid,test}-data-path.

    Each split is sized for its sample count (Megatron's: train = iterations x global batch,
    valid = (train_iters // eval_interval + 1) x eval_iters x global batch, test = eval_iters x
    global batch). Call on every rank alike (after the process group exists): global rank 0
    builds missing index caches under --data-cache-path while the others wait.
    """
    data, model, seed = configs.data, configs.model, configs.training.seed
    counts = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    for name, count in counts.items():
        if count < 0:
            raise ValueError(f"{name}_samples must not be negative, got {count}")
    built: dict[str, BatchSource | None] = {}
    if not data.real_data:
        for name, count in counts.items():
            wanted = name == "train" or (count > 0 and _mock_has_split(data, name))
            built[name] = (
                MockGPTDataset(model.vocab_size, model.seq_length, seed, split=name)
                if wanted
                else None
            )
        return BatchSources(**built)
    masks = _masks(data, configs.parallel.context_parallel_size)
    context = BuildContext.from_torch()
    for name, count in counts.items():
        source = data_split_source(data, name)
        if source is None or (name != "train" and count == 0):
            built[name] = None
            continue
        dataset = build_split_dataset(
            source,
            num_samples=count,
            seq_length=model.seq_length,
            seed=seed,
            cache_dir=data.data_cache_path,
            context=context,
        )
        built[name] = GPTBatchSource(dataset, model.vocab_size, masks, split=name)
    return BatchSources(**built)


def build_batch_source(configs: Configs) -> BatchSource:
    """The training split alone, sized for --train-iters x --global-batch-size samples."""
    training = configs.training
    train_samples = training.train_iters * training.global_batch_size
    return build_batch_sources(
        configs, train_samples=train_samples, valid_samples=0, test_samples=0
    ).train
