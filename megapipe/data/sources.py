"""The one place training asks for its data: a batch source for --mock-data or real datasets."""

from __future__ import annotations

from megapipe.config import Configs
from megapipe.data.config_check import data_tokenizer
from megapipe.data.gpt_batches import GPTBatchSource
from megapipe.data.gpt_builder import build_train_dataset
from megapipe.data.index_cache import BuildContext
from megapipe.data.masks import MaskOptions
from megapipe.data.mock import MockGPTDataset


def build_batch_source(configs: Configs) -> MockGPTDataset | GPTBatchSource:
    """Mock samples, or the training split of --data-path / --train-data-path.

    Call on every rank (after the process group exists): global rank 0 builds missing index
    caches under --data-cache-path while the others wait. Sized for --train-iters x
    --global-batch-size samples.
    """
    data, training = configs.data, configs.training
    if not data.real_data:
        return MockGPTDataset(configs.model.vocab_size, configs.model.seq_length, training.seed)
    tokenizer = data_tokenizer(data)
    needs_eod = data.eod_mask_loss or data.reset_position_ids or data.reset_attention_mask
    masks = MaskOptions(
        eod=tokenizer.eod if needs_eod else -1,
        eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
    )
    dataset = build_train_dataset(
        data_path=data.data_path,
        split=data.split,
        train_data_path=data.train_data_path,
        num_samples=training.train_iters * training.global_batch_size,
        seq_length=configs.model.seq_length,
        seed=training.seed,
        cache_dir=data.data_cache_path,
        context=BuildContext.from_torch(),
    )
    return GPTBatchSource(dataset, configs.model.vocab_size, masks)
