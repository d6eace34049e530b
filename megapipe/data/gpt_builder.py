"""Build the dataset of one split (train, valid or test) that Megatron's data flags describe:
one prefix, or a weighted blend, from --data-path with --split, or from --train-data-path /
--valid-data-path / --test-data-path (each used whole).

As in megatron.core: each prefix is split by its own sequence count; a weighted blend builds each
dataset with its share of the samples plus 0.5% and blends sum(ceil(size x weight)) samples; an
unweighted list of prefixes takes one epoch of each, blended in proportion to their lengths.
The same rules hold for every split; each split's GPTDataset carries its name (so its cached
indices are its own) and shuffles only its own documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.data.blending import SURPLUS, BlendedDataset, parse_blend, samples_per_dataset
from megapipe.data.errors import DataError
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.index_cache import BuildContext
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.splits import SPLIT_NAMES, normalize, parse_split, split_matrix, split_range

# How messages name each split.
SPLIT_LABELS = {"train": "training", "valid": "validation", "test": "test"}


@dataclass(frozen=True)
class SplitSource:
    """Where one split's documents come from: the flag, its blend words, and the book-ends
    (fractions of each prefix's documents); `split` is the --split value when it applies."""

    name: str
    flag: str
    words: tuple[str, ...]
    bookends: tuple[float, float]
    split: str | None = None

    @property
    def label(self) -> str:
        return SPLIT_LABELS[self.name]


def split_source(
    name: str, *, data_path: Sequence[str], split: str, split_data_path: Sequence[str] = ()
) -> SplitSource | None:
    """The source of split `name`, or None when it has none (a zero share of --split, or no
    --{name}-data-path). `split_data_path` is that split's own path flag's words."""
    if name not in SPLIT_NAMES:
        raise ValueError(f"unknown split {name!r}; expected one of {SPLIT_NAMES}")
    if data_path:
        bookends = split_matrix(parse_split(split))[SPLIT_NAMES.index(name)]
        if bookends is None:
            return None
        return SplitSource(name, "--data-path", tuple(data_path), bookends, split)
    if split_data_path:
        return SplitSource(name, f"--{name}-data-path", tuple(split_data_path), (0.0, 1.0))
    return None


def train_source(
    data_path: Sequence[str], split: str, train_data_path: Sequence[str]
) -> SplitSource:
    """The training split's source; a DataError when the flags leave nothing for training."""
    source = split_source(
        "train", data_path=data_path, split=split, split_data_path=train_data_path
    )
    if source is None:
        raise DataError(f"--split {split!r} leaves nothing for training")
    return source


def split_documents(indexed: IndexedDataset, source: SplitSource) -> tuple[int, int]:
    """The [begin, end) sequence range of the split, checked to hold a sample's tokens."""
    begin, end = split_range(source.bookends, len(indexed))
    tokens = int(indexed.sequence_lengths[begin:end].sum()) if end > begin else 0
    if tokens < 2:
        where = f" (--split {source.split!r})" if source.split is not None else ""
        raise DataError(
            f"{source.flag} {indexed.path_prefix}: the {source.label} split holds "
            f"{end - begin} of {len(indexed)} documents and {tokens} tokens{where}; "
            "a GPT sample needs at least 2"
        )
    return begin, end


def check_split_source(source: SplitSource) -> None:
    """Open every prefix of the split and check that its share holds tokens (cheap: no indices)."""
    for prefix in parse_blend(source.words, source.flag)[0]:
        split_documents(IndexedDataset(prefix), source)


def build_split_dataset(
    source: SplitSource,
    *,
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    context: BuildContext | None = None,
) -> GPTDataset | BlendedDataset:
    """The samples of one split: at least `num_samples`, each seq_length + 1 tokens."""
    context = context or BuildContext()
    prefixes, weights = parse_blend(source.words, source.flag)

    def one(prefix: str, samples: int | None) -> GPTDataset:
        indexed = IndexedDataset(prefix)
        return GPTDataset(
            indexed,
            split_documents(indexed, source),
            samples,
            seq_length,
            seed,
            split=source.name,
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
            f"{source.flag}: one epoch of the {len(prefixes)} unweighted datasets gives "
            f"{sum(lengths)} {source.label} samples, fewer than the {num_samples} {source.label} "
            "needs; give weights (e.g. 0.5 A 0.5 B) to draw more epochs"
        )
    return BlendedDataset(datasets, lengths, num_samples, cache_dir=cache_dir, context=context)


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
    return build_split_dataset(
        train_source(data_path, split, train_data_path),
        num_samples=num_samples,
        seq_length=seq_length,
        seed=seed,
        cache_dir=cache_dir,
        context=context,
    )
