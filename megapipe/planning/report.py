"""The text tools/plan.py prints: the ranking, why the top layout wins, what was rejected."""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.pipeline.stage_memory import stage_parameters
from megapipe.planning.cluster import GIB
from megapipe.planning.search import Evaluated, Plan


def describe_model(model: ModelConfig) -> str:
    params = stage_parameters(model, model.num_layers, True, True, 1)
    mlp = "SwiGLU" if model.swiglu else "GeLU"
    return (
        f"{model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} "
        f"heads ({model.num_query_groups} query groups), ffn {model.ffn_hidden_size} {mlp}, "
        f"vocab {model.vocab_size}, seq {model.seq_length}: {params / 1e9:.2f}B parameters"
    )


def time_terms(entry: Evaluated) -> str:
    t = entry.time
    terms = " + ".join(f"{name} {seconds:.3f}" for name, seconds in t.terms().items())
    return f"step {t.total:.3f} s = {terms} (bubble {t.bubble_fraction:.1%} of the stage's work)"


def memory_terms(entry: Evaluated) -> str:
    m = entry.memory
    return (
        f"memory {m.total / GIB:.1f} GiB per GPU (largest: stage {m.stage}, "
        f"{m.parameters / 1e6:.0f}M parameters) = params {m.params / GIB:.1f} + grads "
        f"{m.grads / GIB:.1f} + optimizer {m.optimizer / GIB:.1f} + activations "
        f"{m.activations / GIB:.1f} (micro-batches in flight: {m.in_flight})"
    )


def _row(rank: int, entry: Evaluated) -> str:
    t = entry.time
    return (
        f"{rank:4d} | {entry.layout.describe():<64} | {t.bubble_fraction:6.1%} | "
        f"{t.total:8.3f} | {t.tflops_per_gpu:7.1f} | {entry.memory.total / GIB:7.1f}"
    )


def why_top(plan: Plan, alternatives: int = 4) -> list[str]:
    """The top layout's terms, and the terms in which the best layout of each other (TP, PP)
    loses to it."""
    top = plan.ranked[0]
    lines = [f"why #1 ({top.layout.describe()}) wins:", f"  {time_terms(top)}",
             f"  {memory_terms(top)}"]  # fmt: skip
    seen = {(top.layout.tp, top.layout.pp)}
    others = []
    for rank, entry in enumerate(plan.ranked, 1):
        key = (entry.layout.tp, entry.layout.pp)
        if key not in seen:
            seen.add(key)
            others.append((rank, entry))
    if others:
        lines.append("  the best layout of each other (TP, PP), and what it loses on:")
    for rank, entry in others[:alternatives]:
        diffs = {
            name: entry.time.terms()[name] - top.time.terms()[name] for name in top.time.terms()
        }
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:2]
        losses = ", ".join(f"{name} {delta:+.3f} s" for name, delta in worst if delta > 0)
        slower = entry.time.total / top.time.total - 1
        lines.append(f"    #{rank} {entry.layout.describe()}: {entry.time.total:.3f} s "
                     f"({slower:+.1%}): {losses or 'ties on time, more memory'}")  # fmt: skip
    return lines


def format_plan(
    plan: Plan, top: int = 10, explain: bool = False, show_rejected: bool = False
) -> str:
    options, knobs = plan.options, plan.options.knobs
    lines = [
        f"model: {describe_model(plan.model)}; global batch {plan.global_batch}",
        f"cluster: {plan.cluster.describe()}",
        f"assumptions: {'bf16' if knobs.half_precision else 'fp32'}, Adam, TP overlap "
        f"{knobs.tp_overlap:.0%}, DP overlap {knobs.dp_overlap:.0%}, memory limit "
        f"{options.memory_fraction:.0%} of the GPU, sequence parallel "
        f"{'on' if options.sequence_parallel else 'off'}",
    ]
    counts = plan.rejected_counts()
    summary = ", ".join(f"{n} {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines.append(
        f"feasible layouts: {len(plan.ranked)}; rejected: {summary or 'none'}"
        + ("" if show_rejected or not counts else " (--show-rejected lists them)")
    )
    if plan.ranked:
        lines.append("")
        lines.append(f"rank | {'layout':<64} | bubble | step (s) | TFLOP/s | mem GiB")
        for rank, entry in enumerate(plan.ranked[:top], 1):
            lines.append(_row(rank, entry))
            if explain:
                lines += [f"       {time_terms(entry)}", f"       {memory_terms(entry)}"]
        lines.append("")
        lines += why_top(plan)
    else:
        lines.append("no layout fits: see the rejections (--show-rejected)")
    if show_rejected and plan.rejected:
        lines.append("")
        lines.append("rejected:")
        lines += [f"  {r.what}: {r.reason}" for r in plan.rejected]
    return "\n".join(lines)
