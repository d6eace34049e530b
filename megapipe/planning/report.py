"""The text tools/plan.py prints: the ranking, why the top layout wins, whether sharded data
parallelism (ZeRO-2/3) beats model parallelism on the cluster, what was rejected."""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.pipeline.stage_parameters import active_parameters, stage_parameters
from megapipe.planning.cluster import GIB
from megapipe.planning.layout import FSDP_SHARDING, SHARDING
from megapipe.planning.search import Evaluated, Plan


def describe_model(model: ModelConfig) -> str:
    params = stage_parameters(model, model.num_layers, True, True, 1)
    mlp = "SwiGLU" if model.swiglu else "GeLU"
    moe, active = model.moe, ""
    if moe is not None:
        layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
        shared = moe.moe_shared_expert_intermediate_size
        mlp += (f", {moe.num_experts} experts (ffn {model.moe_ffn_hidden_size}) top-"
                f"{moe.moe_router_topk} on {layers} layers"
                + (f" + a shared expert (ffn {shared})" if shared else ""))  # fmt: skip
        active = f" ({active_parameters(model) / 1e9:.2f}B active per token)"
    return (
        f"{model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} "
        f"heads ({model.num_query_groups} query groups), ffn {model.ffn_hidden_size} {mlp}, "
        f"vocab {model.vocab_size}, seq {model.seq_length}: {params / 1e9:.2f}B parameters"
        f"{active}"
    )


def time_terms(entry: Evaluated) -> str:
    t = entry.time
    terms = " + ".join(f"{name} {seconds:.3f}" for name, seconds in t.terms().items())
    gathers = f", DP all-gathers {t.dp_gather:.3f} of it" if t.dp_gather > 0 else ""
    return (f"step {t.total:.3f} s = {terms} (bubble {t.bubble_fraction:.1%} of the stage's "
            f"work{gathers})")  # fmt: skip


def memory_terms(entry: Evaluated) -> str:
    m = entry.memory
    gathered = f" + gathered params {m.gathered / GIB:.1f}" if m.gathered else ""
    experts = f", {m.expert_parameters / 1e6:.0f}M in experts" if m.expert_parameters else ""
    return (
        f"memory {m.total / GIB:.1f} GiB per GPU (largest: stage {m.stage}, "
        f"{m.parameters / 1e6:.0f}M parameters{experts}) = params {m.params / GIB:.1f} + grads "
        f"{m.grads / GIB:.1f} + optimizer {m.optimizer / GIB:.1f}{gathered} + activations "
        f"{m.activations / GIB:.1f} (micro-batches in flight: {m.in_flight})"
    )


def _row(rank: int, entry: Evaluated) -> str:
    t = entry.time
    return (
        f"{rank:4d} | {entry.layout.describe():<64} | {t.bubble_fraction:6.1%} | "
        f"{t.total:8.3f} | {t.tflops_per_gpu:7.1f} | {entry.memory.total / GIB:7.1f}"
    )


def why_top(plan: Plan, alternatives: int = 4) -> list[str]:
    """The top layout's terms, and the terms in which the best layout of each other (TP, CP,
    EP, PP) loses to it."""
    top = plan.ranked[0]
    lines = [f"why #1 ({top.layout.describe()}) wins:", f"  {time_terms(top)}",
             f"  {memory_terms(top)}"]  # fmt: skip
    seen = {(top.layout.tp, top.layout.cp, top.layout.ep, top.layout.pp)}
    others = []
    for rank, entry in enumerate(plan.ranked, 1):
        key = (entry.layout.tp, entry.layout.cp, entry.layout.ep, entry.layout.pp)
        if key not in seen:
            seen.add(key)
            others.append((rank, entry))
    if others:
        what = "TP, CP, EP, PP" if plan.model.moe is not None else "TP, CP, PP"
        lines.append(f"  the best layout of each other ({what}), and what it loses on:")
    for rank, entry in others[:alternatives]:
        diffs = _differences(entry, top)
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:2]
        losses = ", ".join(f"{name} {delta:+.3f} s" for name, delta in worst if delta > 0)
        slower = entry.time.total / top.time.total - 1
        lines.append(f"    #{rank} {entry.layout.describe()}: {entry.time.total:.3f} s "
                     f"({slower:+.1%}): {losses or 'ties on time, more memory'}")  # fmt: skip
    return lines


def _differences(entry: Evaluated, other: Evaluated) -> dict[str, float]:
    """Each time term of `entry` less `other`'s (a term one of them lacks, CP's, counts 0)."""
    ours, theirs = entry.time.terms(), other.time.terms()
    return {name: ours.get(name, 0.0) - theirs.get(name, 0.0) for name in {**theirs, **ours}}


def _loses_on(entry: Evaluated, other: Evaluated) -> str:
    """The term in which `entry` is slower than `other` by the most."""
    name, delta = max(
        _differences(entry, other).items(),
        key=lambda kv: kv[1],
    )
    return f"{name} {delta:+.3g} s"


def sharding_verdict(plan: Plan) -> str:
    """One line: whether the best pure sharded-DP layout (TP1 CP1 PP1, ZeRO-2/3) fits, and how
    its step compares with the best model-parallel one (TP x CP x PP > 1, plain DP or ZeRO-1;
    "TP x PP" in the line, as CP is named in the layout)."""
    world = plan.cluster.world_size
    what = "sharded DP vs TP x PP: "
    if world == 1:
        return what + "one GPU: nothing to shard or split"
    if not set(FSDP_SHARDING) & set(plan.options.sharding):
        return what + "ZeRO-2/3 not searched (--sharding)"
    sharded = plan.position(lambda x: x.tp == x.pp == x.cp == 1 and x.fsdp)
    model_parallel = plan.position(lambda x: x.tp * x.pp * x.cp > 1 and not x.fsdp)
    if model_parallel:
        mp = model_parallel[1]
        best_mp = (f"the best TP x PP layout (#{model_parallel[0]} {mp.layout.describe()}, "
                   f"{mp.time.total:.3g} s, {mp.memory.total / GIB:.3g} GiB)")  # fmt: skip
    if sharded:
        sh = sharded[1]
        name = f"{SHARDING[sh.layout.sharding]} at DP{world}"
        fits = (f"{name} fits (#{sharded[0]} {sh.layout.describe()}, {sh.time.total:.3g} s, "
                f"{sh.memory.total / GIB:.3g} GiB)")  # fmt: skip
        if not model_parallel:
            return what + f"{fits}; no TP x PP layout does"
        if sh.time.total <= mp.time.total:
            faster = 1 - sh.time.total / mp.time.total
            return what + f"{fits} and is {faster:.0%} faster than {best_mp}"
        slower = sh.time.total / mp.time.total - 1
        return what + (f"{fits} but is {slower:.0%} slower than {best_mp}: "
                       f"{_loses_on(sh, mp)}")  # fmt: skip
    over = [r for r in plan.rejected if r.layout is not None and r.memory_bytes is not None
            and r.layout.tp == r.layout.pp == r.layout.cp == 1 and r.layout.fsdp]  # fmt: skip
    if over:
        least = min(over, key=lambda r: r.memory_bytes or 0.0)
        why = f"the smallest ({least.what}) {least.reason}"
    else:
        reasons = [r.reason for r in plan.rejected if r.what.startswith("TP1 PP1 ")]
        why = reasons[0] if reasons else "none was searched"
    line = f"no ZeRO-2/3 layout at DP{world} fits: {why}"
    return what + line + (f"; {best_mp} does" if model_parallel else "")


def format_plan(
    plan: Plan, top: int = 10, explain: bool = False, show_rejected: bool = False
) -> str:
    options, knobs = plan.options, plan.options.knobs
    lines = [
        f"model: {describe_model(plan.model)}; global batch {plan.global_batch}",
        f"cluster: {plan.cluster.describe()}",
        f"assumptions: {'bf16' if knobs.half_precision else 'fp32'}, Adam, TP overlap "
        f"{knobs.tp_overlap:.0%}, DP overlap {knobs.dp_overlap:.0%}, ZeRO-2/3 gather overlap "
        f"{knobs.param_gather_overlap:.0%}, memory limit "
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
        lines.append(sharding_verdict(plan))
    else:
        lines.append("no layout fits: see the rejections (--show-rejected)")
        lines.append(sharding_verdict(plan))
    if show_rejected and plan.rejected:
        lines.append("")
        lines.append("rejected:")
        lines += [f"  {r.what}: {r.reason}" for r in plan.rejected]
    return "\n".join(lines)
