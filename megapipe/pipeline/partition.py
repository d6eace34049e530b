"""Which transformer layers each (pipeline rank, model chunk) owns. Never drops a layer.

Virtual stage s = chunk * p + rank holds a contiguous run of layers, in stage order. Three ways
to choose the runs, as in Megatron-LM plus one:

* uniform: num_layers / (p * v) each; anything else is an error naming the numbers;
* first/last overrides (--decoder-first/last-pipeline-num-layers): the first and/or last stage
  get the given counts and the rest split evenly among the middle stages;
* balanced: a contiguous split minimising the most expensive stage in FLOPs per token, where
  the last stage also pays for the output layer (2 h V) - the embedding lookup is nearly free -
  so a big vocabulary does not make the last stage the straggler;
* memory: a contiguous split whose stages' estimated peak memory deviates least from the mean
  (`stage_memory.MemoryModel`: parameters, gradients, optimizer state, and the activations of
  the micro-batches each stage keeps in flight), so the first stages of 1F1B, which hold the
  most micro-batches, get fewer layers. The estimate is of the layers a stage would hold, so
  with --moe-layer-freq a stage of MoE layers (their experts: E / EP per rank) weighs more
  than one of dense layers.
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.config import ModelConfig, StageMap
from megapipe.errors import ConfigError


def _from_counts(counts: list[int], p: int, v: int) -> StageMap:
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [range(start, start + n) for start, n in zip(starts, counts)]
    return StageMap(tuple(tuple(stages[c * p + r] for c in range(v)) for r in range(p)))


def uniform_counts(
    num_layers: int, p: int, v: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layer count per virtual stage: even split, with optional first/last stage overrides."""
    stages = p * v
    if first is not None or last is not None:
        if v > 1:
            raise ConfigError(
                "--decoder-first/last-pipeline-num-layers cannot be combined with "
                f"virtual pipeline stages (got {v} per rank)"
            )
        fixed = (first or 0) + (last or 0)
        middle = stages - (first is not None) - (last is not None)
        rest = num_layers - fixed
        names = " + ".join(
            f"--decoder-{w}-pipeline-num-layers ({n})"
            for w, n in (("first", first), ("last", last))
            if n is not None
        )
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise ConfigError(
                f"--num-layers ({num_layers}) minus {names} leaves {rest} layers, which do not "
                f"split evenly over the {middle} remaining stages of "
                f"--pipeline-model-parallel-size ({p})"
            )
        each = rest // middle if middle else 0
        counts = [each] * stages
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    if num_layers % stages:
        what = f"{p} pipeline stages" + (f" x {v} virtual stages per rank" if v > 1 else "")
        raise ConfigError(
            f"--num-layers ({num_layers}) is not divisible by {what} = {stages}; use a multiple "
            f"of {stages}, --decoder-first/last-pipeline-num-layers, or the balanced partition"
        )
    return [num_layers // stages] * stages


def layer_flops_per_token(config: ModelConfig) -> float:
    """Forward FLOPs per token of one transformer layer (matmuls + causal attention)."""
    h, ffn, s = config.hidden_size, config.ffn_hidden_size, config.seq_length
    q = config.num_attention_heads * config.head_dim  # h unless --kv-channels says otherwise
    kv = 2 * config.num_query_groups * config.head_dim
    linear = 2 * h * (q + kv) + 2 * q * h + 2 * h * ffn * (3 if config.swiglu else 2)
    attention = 2 * s * q  # QK^T and AV over the causal half of the sequence
    return float(linear + attention)


StageCost = Callable[[int, range], float]  # (stage, its layers' global indices) -> cost


def min_max_counts(num_layers: int, stages: int, cost: StageCost) -> list[int]:
    """Contiguous layer counts (at least one each) minimising the largest `cost(stage,
    layers)`, `layers` the range of global indices the stage would hold."""
    return _min_max(num_layers, stages, _cost_table(num_layers, stages, cost))


def _cost_table(num_layers: int, stages: int, cost: StageCost) -> list[list[list[float]]]:
    """table[s][j][k]: the cost of stage s holding layers j..k-1 (0 when empty; only the
    splits that leave every stage at least one layer are filled)."""
    n, inf = num_layers, float("inf")
    table = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(stages)]
    for s in range(stages):
        for j in range(s, n - (stages - s) + 1):
            for k in range(j + 1, n - (stages - s - 1) + 1):
                table[s][j][k] = cost(s, range(j, k))
    return table


def _min_max(
    num_layers: int, stages: int, table: list[list[list[float]]], level: float | None = None
) -> list[int]:
    """The min-max split over `_cost_table`'s costs (or their distances from `level`)."""
    n = num_layers
    if n < stages:
        raise ConfigError(f"--num-layers ({n}) is smaller than the {stages} pipeline stages")
    inf = float("inf")
    # best[s][k]: minimal max-cost of putting the first k layers on the first s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        previous, rows = best[s - 1], table[s - 1]
        for k in range(s, n - (stages - s) + 1):
            for j in range(s - 1, k):  # stage s-1 takes layers j..k-1
                c = rows[j][k] if level is None else abs(rows[j][k] - level)
                value = previous[j] if previous[j] > c else c
                if value < best[s][k]:
                    best[s][k], choice[s][k] = value, j
    counts, k = [], n
    for s in range(stages, 0, -1):
        j = choice[s][k]
        counts.append(k - j)
        k = j
    return counts[::-1]


def even_counts(num_layers: int, stages: int, cost: StageCost, targets: int = 48) -> list[int]:
    """Contiguous layer counts whose stage costs deviate least from their mean (ties: the
    smaller largest cost). Exact for a given target level, searched over `targets` levels
    between the cheapest and the dearest stage, and the min-max split's mean. The cost of a
    stage may depend on which layers it holds (mixtures of experts on some layers only)."""
    if num_layers < stages:
        raise ConfigError(
            f"--num-layers ({num_layers}) is smaller than the {stages} pipeline stages"
        )
    table = _cost_table(num_layers, stages, cost)

    def costs(counts: list[int]) -> list[float]:
        starts = [sum(counts[:s]) for s in range(stages)]
        return [table[s][a][a + k] for s, (a, k) in enumerate(zip(starts, counts))]

    def score(counts: list[int]) -> tuple[float, float]:
        values = costs(counts)
        mean = sum(values) / stages
        return max(abs(c - mean) for c in values) / mean, max(values)

    best = _min_max(num_layers, stages, table)
    baseline = costs(best)
    levels = [sum(baseline) / stages]
    singles = [table[s][j][j + 1] for s in range(stages) for j in range(num_layers)]
    low = min(c for c in singles if c != float("inf"))
    high = max(baseline)
    levels += [low + (high - low) * i / (targets - 1) for i in range(targets)]
    for level in levels:
        counts = _min_max(num_layers, stages, table, level)
        if score(counts) < score(best):
            best = counts
    return best


def balanced_counts(config: ModelConfig, p: int, v: int) -> list[int]:
    """Contiguous layer counts per virtual stage minimising the costliest stage.

    The last stage also pays for the output layer (2 h V FLOPs per token, plus the loss), so it
    tends to get fewer transformer layers. Every stage gets at least one layer.
    """
    layer = layer_flops_per_token(config)
    head = 2.0 * config.hidden_size * config.padded_vocab_size(1)
    last = p * v - 1
    return min_max_counts(
        config.num_layers,
        p * v,
        lambda stage, layers: len(layers) * layer + (head if stage == last else 0.0),
    )


def partition_layers(
    config: ModelConfig,
    p: int,
    v: int = 1,
    *,
    method: str = "uniform",
    first: int | None = None,
    last: int | None = None,
    stage_bytes: StageCost | None = None,
) -> StageMap:
    """The stage map for a pipeline of p ranks with v chunks each.

    stage_bytes: (stage, its layers' global indices) -> estimated peak bytes, which the
    memory method needs (`stage_memory.MemoryModel.stage_bytes`: it counts each MoE layer's
    experts)."""
    if method == "memory":
        if v > 1 or first is not None or last is not None:
            raise ConfigError(
                "--pipeline-partition memory chooses every stage's layers itself: it cannot "
                "be combined with virtual pipeline stages or --decoder-first/last-pipeline-num-"
                "layers"
            )
        if stage_bytes is None:
            raise ValueError("the memory partition needs the stage memory estimate")
        counts = even_counts(config.num_layers, p, stage_bytes)
    elif method == "balanced":
        if first is not None or last is not None:
            raise ConfigError(
                "--decoder-first/last-pipeline-num-layers and the balanced "
                "partition are alternatives; pass one"
            )
        counts = balanced_counts(config, p, v)
    elif method == "uniform":
        counts = uniform_counts(config.num_layers, p, v, first, last)
    else:
        raise ConfigError(
            f"pipeline partition method {method!r} is not uniform, balanced or memory"
        )
    stage_map = _from_counts(counts, p, v)
    covered = [i for r in stage_map.stage_ranges() for i in r]
    assert covered == list(range(config.num_layers)), "partition dropped or repeated a layer"
    return stage_map
