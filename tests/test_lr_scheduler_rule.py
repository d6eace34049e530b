"""--decoupled-lr, and Megatron-LM's rule for the LR schedule of a resumed run.

- `--decoupled-lr`: after a few steps at one rank the weights equal those of a plain
  `torch.optim.AdamW` with the embedding and output layer in groups of their own, both groups'
  LRs written out below from Megatron's formula (warmup, then cosine decay); TP2 (untied), PP2
  (tied: the last stage's copy follows the embedding's LR), DP2 with the distributed optimizer
  (untied) and with FSDP2 (tied) give the one-rank losses and grad norms.
- The resume rule, in both checkpoint formats: saved at iteration 2 of --train-iters 4 and
  resumed with --train-iters 6, the run stops with one line naming --train-iters, both decay
  lengths and the two options; --override-opt_param-scheduler follows the new schedule,
  --use-checkpoint-opt_param-scheduler the old one exactly (the uninterrupted run's LRs and
  losses); a checkpoint from before the settings were recorded loads with a note.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so that forked ranks inherit it)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megapipe.checkpointing.scheduler_rule import ScheduleSettings, settle
from megapipe.config import CheckpointConfig, ModelConfig
from megapipe.data.mock import MockGPTDataset
from megapipe.errors import ConfigError
from megapipe.testing import DistributedTestError, run_distributed
from tests.helpers import (
    MOCK,
    MODEL,
    NO_DROPOUT,
    optimizer_argv,
    parity_losses_and_norms,
    refresh_checksums,
    run,
)

# --- --decoupled-lr against plain torch.optim.AdamW -------------------------------------------

STEPS, MICRO_BATCH, GLOBAL_BATCH, SEED, VOCAB, SEQ = 4, 2, 4, 1234, 256, 32
LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR, WARMUP = 2e-3, 2e-4, 1e-2, 1e-3, 1
WEIGHT_DECAY, CLIP, BETAS, EPS = 0.1, 1.0, (0.9, 0.95), 1e-8
ARGV = [
    *optimizer_argv(
        steps=STEPS,
        micro=MICRO_BATCH,
        batch=GLOBAL_BATCH,
        lr=LR,
        min_lr=MIN_LR,
        warmup=WARMUP,
        weight_decay=WEIGHT_DECAY,
        clip=CLIP,
        betas=BETAS,
        eps=EPS,
        seed=SEED,
        vocab=VOCAB,
        seq=SEQ,
    ),
    "--untie-embeddings-and-output-weights",
]
DECOUPLED = ["--decoupled-lr", str(DECOUPLED_LR), "--decoupled-min-lr", str(DECOUPLED_MIN_LR)]
EMBEDDING_AND_OUTPUT = ("wte.weight", "lm_head.weight")  # PlainGPT's names


def megatron_lr(updates: float, peak: float, floor: float, warmup: float, decay: float) -> float:
    """Megatron's LR after `updates` steps: linear warmup from 0, cosine decay to `floor`."""
    if warmup > 0 and updates <= warmup:
        return peak * updates / warmup
    if updates > decay:
        return floor
    ratio = (updates - warmup) / (decay - warmup)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def _megapipe_weights(rank: int, world_size: int, extra: list[str]) -> dict[str, torch.Tensor]:
    """One rank of the training loop; its final weights under PlainGPT's names."""
    from megapipe.arguments import parse_args
    from megapipe.parallel.state import ParallelState
    from megapipe.testing.reference_gpt import plain_name
    from megapipe.training.build import build_run
    from megapipe.training.train import TrainingLoop

    built = build_run(parse_args(ARGV + extra, world_size), ParallelState.build(1, 1))
    with contextlib.redirect_stdout(io.StringIO()):
        TrainingLoop(built).run()
    return {plain_name(n): p.detach().clone() for n, p in built.chunks[0].named_parameters()}


def _plain_weights(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The reference: PlainGPT from the same initial weights, torch's AdamW with the embedding
    and output layer in groups of their own, LambdaLRs of Megatron's schedule per group."""
    from megapipe.model import GPTModel
    from megapipe.parallel.random import RNGTracker
    from megapipe.parallel.state import ParallelState
    from megapipe.testing.reference_gpt import reference_from_megapipe

    config = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        seq_length=SEQ, vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    initial = GPTModel(config, ParallelState.single(), RNGTracker(SEED), seed=SEED)
    model = reference_from_megapipe(initial).train()
    named = dict(model.named_parameters())
    groups = []
    for decoupled in (False, True):
        for decays in (True, False):
            params = [
                p
                for n, p in named.items()
                if (n in EMBEDDING_AND_OUTPUT) == decoupled and (p.dim() > 1) == decays
            ]
            peak = DECOUPLED_LR if decoupled else LR
            wd = WEIGHT_DECAY if decays else 0.0
            groups.append({"params": params, "lr": peak, "weight_decay": wd})
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, betas=BETAS, eps=EPS)

    def schedule(peak: float, floor: float):
        return lambda n: megatron_lr(n, peak, floor, WARMUP, STEPS) / peak

    lambdas = [
        schedule(DECOUPLED_LR, DECOUPLED_MIN_LR)
        if g["lr"] == DECOUPLED_LR
        else schedule(LR, MIN_LR)
        for g in groups
    ]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    data = MockGPTDataset(VOCAB, SEQ, SEED)
    micro_batches = GLOBAL_BATCH // MICRO_BATCH
    for step in range(STEPS):
        for m in range(micro_batches):
            start = step * GLOBAL_BATCH + m * MICRO_BATCH
            batch = data.batch(range(start, start + MICRO_BATCH))
            (model(batch.tokens, batch.labels).mean() / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in named.items()}


def test_decoupled_lr_trains_like_adamw_with_two_schedules() -> None:
    ours = run_distributed(_megapipe_weights, 1, DECOUPLED)[0]
    plain = run_distributed(_plain_weights, 1)[0]
    assert sorted(ours) == sorted(plain)
    for name, expected in plain.items():
        # The key bias's gradient is zero but for rounding, which Adam scales up to ~lr/1000:
        # measured 3e-6 there, at most 1.4e-7 elsewhere.
        atol = 1e-5 if name.endswith("qkv.bias") else 1e-6
        torch.testing.assert_close(ours[name], expected, rtol=1e-4, atol=atol, msg=name)
    coupled = run_distributed(_megapipe_weights, 1, [])[0]
    for name in EMBEDDING_AND_OUTPUT:  # a decoupled LR 5x --lr moved them further
        moved = (ours[name] - coupled[name]).abs().max().item()
        assert moved > 1e-3, (name, moved)


# --- parity: --decoupled-lr at every layout ---------------------------------------------------

PARITY_DECOUPLED = ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3", "--min-lr", "3e-4"]
UNTIED = ["--untie-embeddings-and-output-weights"]
LAYOUTS = {  # name: (ranks, flags), against the one-rank run of the same tying
    "tp2-untied": (2, UNTIED + ["--tensor-model-parallel-size", "2"]),
    "dp2-distopt-untied": (2, UNTIED + ["--use-distributed-optimizer"]),
    "pp2-tied": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2-fsdp2-tied": (2, ["--use-torch-fsdp2"]),
}


@pytest.fixture(scope="module")
def one_rank() -> dict[bool, tuple[list[float], list[float]]]:
    """The one-rank losses and grad norms, untied (True) and tied (False)."""
    return {
        untied: run_distributed(
            parity_losses_and_norms, 1, PARITY_DECOUPLED + (UNTIED if untied else [])
        )[0]
        for untied in (True, False)
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decoupled_lr_layouts_match_one_rank(one_rank, layout: str) -> None:
    world, flags = LAYOUTS[layout]
    losses, norms = one_rank["--untie-embeddings-and-output-weights" in flags]
    for rank_losses, rank_norms in run_distributed(
        parity_losses_and_norms, world, PARITY_DECOUPLED + flags
    ):
        assert rank_losses == pytest.approx(losses, rel=1e-5)
        assert rank_norms == pytest.approx(norms, rel=1e-5)


def test_the_one_rank_parity_runs_depend_on_the_decoupled_lr(one_rank) -> None:
    coupled = run_distributed(parity_losses_and_norms, 1, ["--min-lr", "3e-4"])[0]
    assert coupled[0][2:] != pytest.approx(one_rank[False][0][2:], rel=1e-4)


# --- the resume rule --------------------------------------------------------------------------

RESUME = MODEL + MOCK + NO_DROPOUT + [
    "--num-layers", "2", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--min-lr", "3e-4",
]  # fmt: skip
PEAK, FLOOR, SAVED_AT, FIRST, LONGER = 3e-3, 3e-4, 2, 4, 6  # gbs 8 (MODEL)
LR_LINE = re.compile(r"^ iteration +(\d+)/.*\| learning rate: (\S+) \|")
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


def logged_lrs(stdout: str) -> dict[int, str]:
    """iteration -> the log line's learning rate, as printed."""
    return {int(m[1]): m[2] for m in map(LR_LINE.match, stdout.splitlines()) if m}


def _length(iters: int) -> list[str]:
    return ["--train-iters", str(iters)]


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list, dict[int, str]]:
    results, out = run(1, RESUME + _length(FIRST))
    return results, logged_lrs(out)


def _saved(tmp_path: Path, fmt: str) -> Path:
    save = tmp_path / "ckpt"
    stop = ["--save", str(save), "--exit-interval", str(SAVED_AT), "--ckpt-format", fmt]
    run(1, RESUME + _length(FIRST) + stop)
    return save


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_changed_schedule_is_refused_then_overridden_or_continued(
    fmt: str, tmp_path: Path, uninterrupted
) -> None:
    save = _saved(tmp_path, fmt)
    resume = RESUME + _length(LONGER) + ["--load", str(save)]
    with pytest.raises(DistributedTestError) as refused:
        run(1, resume)
    line = next(x for x in str(refused.value).splitlines() if "ConfigError: " in x)
    assert (
        f"--train-iters: lr_decay_steps {LONGER * 8} here, {FIRST * 8} in the checkpoint" in line
    ), line
    assert "add --override-opt_param-scheduler to follow the command line's" in line
    assert "--use-checkpoint-opt_param-scheduler to continue the checkpoint's" in line

    results, out = run(1, resume + [OVERRIDE])  # the new schedule: decay over 6 iterations
    lrs = logged_lrs(out)
    assert sorted(lrs) == list(range(SAVED_AT + 1, LONGER + 1))
    for k, printed in lrs.items():
        assert float(printed) == pytest.approx(megatron_lr(k, PEAK, FLOOR, 1, LONGER), rel=2e-6), k

    whole, whole_lrs = uninterrupted
    results, out = run(1, resume + [USE_CHECKPOINT])  # the saved schedule, exactly
    lrs = logged_lrs(out)
    assert [lrs[k] for k in (3, 4)] == [whole_lrs[k] for k in (3, 4)]
    assert float(lrs[3]) == pytest.approx(megatron_lr(3, PEAK, FLOOR, 1, FIRST), rel=2e-6)
    assert [float(lrs[k]) for k in (5, 6)] == [FLOOR, FLOOR]  # past the saved decay
    assert [r.lm_loss for r in results[:2]] == [r.lm_loss for r in whole[SAVED_AT:]]


def _forget_settings(save: Path, fmt: str) -> None:
    """Make the checkpoint one from before megapipe recorded the schedule's settings."""
    directory = save / f"iter_{SAVED_AT:07d}"
    if fmt == "torch_dist":
        path = directory / "common.pt"
        common = torch.load(path, weights_only=False)
        del common["opt_param_scheduler"]
    else:
        directory = directory / "mp_rank_00"
        path = directory / "model_optim_rng.pt"
        common = torch.load(path, weights_only=False)
        entry = common["opt_param_scheduler"]
        keep = ("iteration", "consumed_train_samples", "scheduled_samples", "evaluations")
        common["opt_param_scheduler"] = {k: entry[k] for k in keep}
    torch.save(common, path)
    refresh_checksums(str(directory))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_an_older_checkpoint_without_the_settings_loads_with_a_note(fmt, tmp_path: Path) -> None:
    save = _saved(tmp_path, fmt)
    _forget_settings(save, fmt)
    _, out = run(1, RESUME + _length(LONGER) + ["--load", str(save)])
    assert "records no learning-rate schedule settings" in out
    assert sorted(logged_lrs(out)) == list(range(SAVED_AT + 1, LONGER + 1))


def test_decoupled_schedules_continue_from_a_checkpoint(tmp_path: Path, uninterrupted) -> None:
    """Both schedules continue: a decoupled run resumed (the checkpoint's --decoupled-lr and
    weight decay kept over new ones) gives the uninterrupted run's losses; TensorBoard's
    `decoupled-learning-rate` is --decoupled-lr's schedule."""
    flags = RESUME + _length(FIRST) + ["--decoupled-lr", "1e-2"]
    whole, _ = run(1, flags + ["--tensorboard-dir", str(tmp_path / "tb")])
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("decoupled-learning-rate")]
    expected = [megatron_lr(k, 1e-2, FLOOR, 1, FIRST) for k in range(1, FIRST + 1)]
    assert [step for step, _ in logged] == list(range(1, FIRST + 1))
    assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6)
    save = tmp_path / "ckpt"
    run(1, flags + ["--save", str(save), "--exit-interval", str(SAVED_AT)])
    changed = RESUME + _length(FIRST) + ["--decoupled-lr", "5e-3", "--weight-decay", "0.5"]
    changed += ["--load", str(save)]
    with pytest.raises(DistributedTestError, match="--decoupled-lr: decoupled_lr 0.005 here"):
        run(1, changed)
    resumed, _ = run(1, changed + [USE_CHECKPOINT])
    assert [r.lm_loss for r in resumed] == [r.lm_loss for r in whole[SAVED_AT:]]
    assert [r.lm_loss for r in whole] != [r.lm_loss for r in uninterrupted[0]]


# --- the rule itself ----------------------------------------------------------------------------

HERE = {
    "max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 80,
    "lr_decay_style": "linear", "start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": 80,
    "wd_incr_style": "constant", "decoupled_lr": None, "decoupled_min_lr": None,
}  # fmt: skip
FLAGS = {key: f"--flag-of-{key}" for key in HERE}


def test_the_rule_picks_the_command_line_or_the_checkpoint() -> None:
    here = ScheduleSettings(HERE, FLAGS, 8, 10)
    saved = {**HERE, "max_lr": 2e-3, "decoupled_lr": 1e-2, "decoupled_min_lr": 0.0}
    same, note = settle(here, dict(HERE), CheckpointConfig(), "ckpt")
    assert same == HERE and note is None
    chosen, note = settle(here, saved, CheckpointConfig(override_opt_param_scheduler=True), "c")
    assert chosen == HERE and "--flag-of-max_lr: max_lr 0.001 here, 0.002 in the checkpoint" in note
    with pytest.raises(ConfigError) as refused:
        settle(here, saved, CheckpointConfig(use_checkpoint_opt_param_scheduler=True), "ckpt")
    assert "gives the embedding and output layer --decoupled-lr 0.01: add --decoupled-lr" in str(
        refused.value
    )
    with_decoupled = ScheduleSettings({**HERE, "decoupled_lr": 5e-3}, FLAGS, 8, 10)
    use = CheckpointConfig(use_checkpoint_opt_param_scheduler=True)
    chosen, note = settle(with_decoupled, saved, use, "ckpt")
    assert chosen == saved and note.startswith(USE_CHECKPOINT)
    chosen, note = settle(here, None, CheckpointConfig(), "ckpt")
    assert chosen == HERE and "records no learning-rate schedule settings" in note


def test_the_load_plan_checks_only_a_schedule_it_continues() -> None:
    """--finetune, --no-load-optim, a checkpoint without optimizer state and one with nothing
    left to train take the command line's schedule unchecked, as Megatron's loader does."""
    from megapipe.checkpointing.load_plan import Held, plan_load
    from megapipe.checkpointing.run_state import Progress

    here = ScheduleSettings(HERE, FLAGS, 8, 10)
    saved = {**HERE, "lr_decay_steps": 40}
    held = Held(has_optimizer=True, has_rng=False, layout=None, scheduler=saved)
    with pytest.raises(ConfigError, match="lr_decay_steps 80 here, 40 in the checkpoint"):
        plan_load(CheckpointConfig(load="x"), "d", 5, held, {}, here)
    bare = Held(has_optimizer=False, has_rng=False, layout=None, scheduler=saved)
    for flags, holds, iteration in [
        ({"finetune": True}, held, 5),
        ({"no_load_optim": True}, held, 5),
        ({}, bare, 5),
        ({}, held, 10),
    ]:
        plan = plan_load(CheckpointConfig(load="x", **flags), "d", iteration, holds, {}, here)
        assert plan.scheduler is None, flags
    use = CheckpointConfig(load="x", use_checkpoint_opt_param_scheduler=True)
    plan = plan_load(use, "d", 5, held, {}, here)
    assert plan.progress(Progress(5, 40, 40, {})).scheduler == saved
    entry = Progress(5, 40, 40, {}, saved)
    assert entry.as_dict()["opt_param_scheduler"] == {**saved, "num_steps": 40}
    assert Progress.from_dict(entry.as_dict()) == entry  # torch_dist's common entries
    assert Progress.from_dict(entry.scheduler_entry()) == entry  # the legacy entry
