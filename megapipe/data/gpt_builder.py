"""Build the training dataset Megatron's data flags describe: one prefix, or a weighted blend,
from --data-path with --split, or from --train-data-path (used whole).

As in megatron.core: each prefix is split by its own sequence count; a weighted blend builds each
dataset with its share of the samples plus 0.5% and blends sum(ceil(size x weight)) samples; an
unweighted list of prefixes takes one epoch of each, blended in proportion to their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.data.blending import SURPLUS, BlendedDataset, parse_blend, samples_per_dataset
from megapipe.data.errors import DataError
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.index_cache import BuildContext
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.splits import SPLIT_NAMES, normalize, parse_split, split_matrix, split_range


def train_source(data_path: Sequence[str], split: str, train_data_path: Sequence[str]):
    """(flag, blend words, split book-ends) of the training data."""
    if train_data_path:
        return "--train-data-path", list(train_data_path), (0.0, 1.0)
    bookends = split_matrix(parse_split(split))[SPLIT_NAMES.index("train")]
    if bookends is None:
        raise DataError(f"--split {split!r} leaves nothing for training")
    return "--data-path", list(data_path), bookends


def split_documents(indexed: IndexedDataset, bookends: tuple[float, float], flag: str):
    """The [begin, end) sequence range of the split, checked to hold a sample's tokens."""
    begin, end = split_range(bookends, len(indexed))
    tokens = int(indexed.sequence_lengths[begin:end].sum()) if end > begin else 0
    if tokens < 2:
        raise DataError(
            f"{flag} {indexed.path_prefix}: the training split holds {end - begin} of "
            f"{len(indexed)} documents and {tokens} tokens; a GPT sample needs at least 2"
        )
    return begin, end


def build_train_dataset(
    *,
    data_path: Sequence[str],
    split: str,
    train_data_path: Sequence[str],
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    context: BuildContext | None = None,
) -> GPTDataset | BlendedDataset:
    """The training samples: at least `num_samples`, each seq_length + 1 tokens."""
    context = context or BuildContext()
    flag, words, bookends = train_source(data_path, split, train_data_path)
    prefixes, weights = parse_blend(words, flag)

    def one(prefix: str, samples: int | None) -> GPTDataset:
        indexed = IndexedDataset(prefix)
        documents = split_documents(indexed, bookends, flag)
        return GPTDataset(
            indexed,
            documents,
            samples,
            seq_length,
            seed,
            split="train",
            cache_dir=cache_dir,
            context=context,
        )

    if len(prefixes) == 1 and weights is None:
        return one(prefixes[0], num_samples)
    if weights is not None:
        weights = normalize(weights)
        targets = samples_per_dataset(weights, num_samples)
        buffers = samples_per_dataset(weights, num_samples, SURPLUS)
        datasets = [one(p, n) for p, n in zip(prefixes, buffers)]
        return BlendedDataset(datasets, weights, sum(targets), cache_dir=cache_dir, context=context)
    datasets = [one(p, None) for p in prefixes]  # one epoch each, weighted by length
    lengths = [len(d) for d in datasets]
    if sum(lengths) < num_samples:
        raise DataError(
            f"{flag}: one epoch of the {len(prefixes)} unweighted datasets gives {sum(lengths)} "
            f"samples, fewer than the {num_samples} training needs; give weights "
            "(e.g. 0.5 A 0.5 B) to draw more epochs"
        )
    return BlendedDataset(datasets, lengths, num_samples, cache_dir=cache_dir, context=context)
