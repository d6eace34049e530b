"""What more than one test module uses. Test modules never import each other: a helper that a
second module needs moves here (made public), fixtures go to conftest.py.

Sections: training runs through the product; Megatron argv; pretrain_gpt.py as a subprocess;
tools loaded as modules; checkpoint tampering; hypothesis settings; transformers models; the
pipeline parity check (its modules imported here, before any rank is forked). Optional packages
(hypothesis, transformers) are imported only where used.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.config import ModelConfig
from megapipe.data.batch import TrainingBatch
from megapipe.distributed import finalize_model_grads, global_grad_norm
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.model_chunks import activation_shape, build_model_chunks
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.schedules import build_schedule
from megapipe.pipeline.simulator import simulate_kind
from megapipe.testing import run_distributed, train_with_flags
from megapipe.testing.parity import shard_errors

if TYPE_CHECKING:
    from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]

# --- training runs through the product (forked gloo ranks, in-process) -------------------------

MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "6",
]  # fmt: skip
MOCK = ["--mock-data", "--vocab-size", "100"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
LOSS_LINE = re.compile(r"^ iteration +(\d+)/.*\| lm loss: (\S+) \|.*\| grad norm: (\S+) \|")
THREE_D = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
]  # fmt: skip


def optimizer_argv(
    *, steps: int, micro: int, batch: int, lr: float, min_lr: float, warmup: int,
    weight_decay: float, clip: float, betas: tuple[float, float], eps: float, seed: int,
    vocab: int, seq: int,
) -> list[str]:  # fmt: skip
    """A tiny 2-layer run (no dropout, cosine LR) whose optimizer settings a test writes out
    again in plain torch: the reference tests' shared command line."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", str(seq), "--vocab-size", str(vocab),
        "--mock-data", "--eval-iters", "0", "--seed", str(seed), "--micro-batch-size", str(micro),
        "--global-batch-size", str(batch), "--train-iters", str(steps), "--lr", str(lr),
        "--min-lr", str(min_lr), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup),
        "--weight-decay", str(weight_decay), "--clip-grad", str(clip), "--adam-beta1",
        str(betas[0]), "--adam-beta2", str(betas[1]), "--adam-eps", str(eps),
        "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "100",
    ]  # fmt: skip


def printed(stdout: str) -> dict[int, tuple[str, str]]:
    """iteration -> (lm loss, grad norm) as printed."""
    return {int(m[1]): (m[2], m[3]) for m in map(LOSS_LINE.match, stdout.splitlines()) if m}


VALIDATION_LINE = re.compile(
    r"^ validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|"
)


def validation_lines(stdout: str) -> list[tuple[str, float, float]]:
    """Megatron's validation lines as printed: (where, e.g. "iteration 2", loss, PPL)."""
    return [
        (m.group(1), float(m.group(2)), float(m.group(3)))
        for m in map(VALIDATION_LINE.match, stdout.splitlines())
        if m
    ]


def run(world: int, flags: list[str]) -> tuple[list, str]:
    """Train `flags` on `world` ranks: the first rank's iteration results, the last's stdout."""
    outputs = run_distributed(train_with_flags, world, flags, timeout=180)
    return outputs[0][0], outputs[-1][1]


# --- Megatron argv ------------------------------------------------------------------------------


def argv(**flags: object) -> list[str]:
    """A valid tiny run, with `flags` (underscores for dashes) added or overriding.

    True adds a switch, None drops a flag.
    """
    base: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "micro_batch_size": 2,
        "train_iters": 10,
        "lr": 1e-3,
        "mock_data": True,
        "vocab_size": 256,
    }
    base.update(flags)
    out: list[str] = []
    for name, value in base.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


# --- pretrain_gpt.py as a subprocess (python, or torchrun for several ranks) --------------------

PRETRAIN_SCRIPT = str(ROOT / "pretrain_gpt.py")


def pretrain_env() -> dict[str, str]:
    """This process's environment less a launcher's variables; one thread; megapipe importable."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def pretrain_command(nproc: int, args: list[str], *launcher: str) -> list[str]:
    """pretrain_gpt.py with `args`: plain python for one rank, torchrun for more."""
    if nproc == 1:
        return [sys.executable, PRETRAIN_SCRIPT, *args]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, "--nproc_per_node", str(nproc), *launcher, PRETRAIN_SCRIPT, *args]


# --- tools loaded as modules --------------------------------------------------------------------


@functools.cache
def load_tool(path: str) -> ModuleType:
    """A script under tools/ (`path` relative to the repository root), imported once."""
    name = Path(path).stem + "_tool"
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_gpt(*argv: str) -> int:
    """tools/checkpoint/convert.py --model-type GPT with `argv`: its exit status."""
    return load_tool("tools/checkpoint/convert.py").main(["--model-type", "GPT", *argv])


# --- checkpoint tampering -----------------------------------------------------------------------


class Evil:
    """Unpickled, it would run `touch marker`: what a safe loader must refuse."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def refresh_checksums(directory: str) -> None:
    """What an attacker would do: make the checksums match the tampered file."""
    from megapipe.checkpointing import atomic_dir

    names = [n for n in os.listdir(directory) if n != "checksums.json"]
    os.unlink(os.path.join(directory, "checksums.json"))
    atomic_dir.write_checksums(directory, atomic_dir.fsync_and_digest(directory, names))


# --- hypothesis ---------------------------------------------------------------------------------


def fuzz_settings(examples: int) -> settings:
    """`examples` examples in CI, the same ones on every run (a CI run must not turn red on a
    draw); MEGAPIPE_FUZZ_EXAMPLES=N runs N fresh random examples instead, to hunt for new bugs.
    A bug found that way gets an `@example` so that CI keeps checking it."""
    from hypothesis import HealthCheck, settings

    hunting = "MEGAPIPE_FUZZ_EXAMPLES" in os.environ
    return settings(
        max_examples=int(os.environ.get("MEGAPIPE_FUZZ_EXAMPLES", examples)),
        derandomize=not hunting,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,  # nothing written into the working tree
    )


# --- transformers models ------------------------------------------------------------------------


def random_hf_model(kind: str, directory: Path) -> None:
    """A small random transformers model saved at `directory`: "gpt2" (GPT-2's default tanh
    GeLU), "gpt2-exact-gelu" or "llama" (saved in transformers' own shards and index)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind.startswith("gpt2"):  # GPT-2's default activation is gelu_new (tanh): --openai-gelu
        config = transformers.GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **({"activation_function": "gelu"} if kind == "gpt2-exact-gelu" else {}),
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # layer norms off their 1/0 init, so they are checked too
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    # Llama through transformers' own sharding and index
    model.save_pretrained(str(directory), max_shard_size="20KB" if kind == "llama" else "5GB")


# --- pipeline parity: the executor against one rank ---------------------------------------------

PARITY_TOLERANCE = 2e-5
PARITY_SEED = 99
PARITY_MICRO_BATCH = 2
# Every pipeline parity test runs on gloo as it is and under NCCL's ordering.
EMULATE = pytest.mark.parametrize("emulate", [False, True], ids=["gloo", "nccl-order"])
# The data-parallel parity run (pretrain_gpt.py's flags), which other layouts are compared with.
PARITY_FLAGS = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "200",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "100",
    "--clip-grad", "0.5", "--weight-decay", "0.1", "--ddp-bucket-size", "3000",
]  # fmt: skip


def parity_losses_and_norms(rank: int, world_size: int, extra: list[str]):
    """One rank of `pretrain_gpt.py PARITY_FLAGS + extra` (for run_distributed): every
    iteration's (losses, grad norms), what the training parity tests compare with one rank's."""
    results, _ = train_with_flags(rank, world_size, PARITY_FLAGS + extra)
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


def parity_config(num_layers: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=120,
        seq_length=8,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=not tied,
    )


def parity_micro_batch(config, step, microbatch):
    """Micro-batch `microbatch` of step `step`, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + microbatch)
    shape = (PARITY_MICRO_BATCH, config.seq_length + 1)
    tokens = torch.randint(0, config.vocab_size, shape, generator=g)
    mask = (torch.rand(PARITY_MICRO_BATCH, config.seq_length, generator=g) > 0.25).float()
    return TrainingBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask)


def pipeline_parity(
    rank,
    world,
    tp,
    pp,
    v,
    kind,
    tied,
    m,
    steps,
    sequence_parallel=False,
    every_stage=False,
    post_ahead=False,
    emulate=False,
):
    """On one rank: `steps` Adam steps of `kind` at tp x pp (v chunks) beside the single-rank
    model; the worst relative errors of losses, norms and first-step gradient shards, the stash
    peak, the freed outputs, the batches read and the tied embedding's final copy."""
    config = parity_config(2 * pp * v, tied)
    state = ParallelState.build(tp, pp)
    stage_map = partition_layers(config, pp, v)
    chunks = build_model_chunks(
        config,
        state,
        RNGTracker(PARITY_SEED, state.tp_rank, state.pp_rank),
        stage_map,
        seed=PARITY_SEED,
        sequence_parallel=sequence_parallel,
    )
    executor = PipelineExecutor(
        chunks,
        state,
        build_schedule(kind, pp, v, m, state.pp_rank, post_ahead=post_ahead),
        num_microbatches=m,
        activation_shape=activation_shape(config, PARITY_MICRO_BATCH, tp, sequence_parallel),
        batch_on_every_stage=every_stage,
        comm=P2PCommunicator(state, emulate_nccl_order=emulate),
    )
    reference = GPTModel(config, ParallelState.single(), RNGTracker(PARITY_SEED), seed=PARITY_SEED)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    out = {"loss": 0.0, "norm": 0.0, "grads": 0.0, "peak": 0, "freed": 0, "reads": []}
    for step in range(steps):

        def read(i, step=step):
            out["reads"].append((step, i))
            return parity_micro_batch(config, step, i)

        losses = executor.run(read)
        finalize_model_grads(chunks, state)
        norm = global_grad_norm(params, state)
        ref_losses = []
        for i in range(m):
            b = parity_micro_batch(config, step, i)
            loss = masked_mean(reference(tokens=b.tokens, labels=b.labels), b.loss_mask)
            (loss / m).backward()
            ref_losses.append(loss.detach())
        ref_norm = global_grad_norm(list(reference.parameters()), ParallelState.single())
        if losses:
            assert len(losses) == m
            err = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses))
            out["loss"] = max(out["loss"], err)
        out["norm"] = max(out["norm"], abs(norm - ref_norm) / ref_norm)
        if step == 0:
            out["grads"] = max(
                max(shard_errors(c, reference, state.tp_rank, tp, grads=True).values())
                for c in chunks
            )
            out["peak"], out["freed"] = executor.peak_stashed, executor.freed_outputs
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    shared = [c.shared_word_embedding() for c in chunks]
    shared = [s.detach().clone() for s in shared if s is not None]
    out["shared"] = shared
    out["has_loss"] = bool(losses)
    return out


def check_pipeline_parity(
    tp: int,
    pp: int,
    v: int,
    kind: str,
    tied: bool,
    m: int,
    post_ahead: bool = False,
    emulate: bool = False,
) -> None:
    """Three steps of `kind` at this layout match one rank; stashing as the simulator says.
    post_ahead: receives posted one unit early (--overlap-p2p-communication, the default).
    emulate: transfers in NCCL's order (--emulate-nccl-p2p-order)."""
    results = run_distributed(
        pipeline_parity,
        tp * pp,
        tp,
        pp,
        v,
        kind,
        tied,
        m,
        3,
        post_ahead=post_ahead,
        emulate=emulate,
    )
    tolerance = PARITY_TOLERANCE
    for r in results:
        assert r["loss"] < tolerance and r["norm"] < tolerance and r["grads"] < tolerance, r
    assert sum(r["has_loss"] for r in results) == tp  # only the last stage computes the loss
    # Activation bound: each rank stashes exactly what the simulator predicts (1F1B: p - rank
    # on rank `rank`, at most p; zero-bubble: counted until W), and every output sent
    # downstream had its storage freed.
    sim = simulate_kind(kind, pp, v, m, post_ahead=post_ahead)
    for rank, r in enumerate(results):
        pp_rank = rank // tp
        # Only the first stage (tokens) and the last (labels, loss mask) read data, each
        # micro-batch once per step.
        reads_data = pp_rank in (0, pp - 1)
        assert sorted(r["reads"]) == sorted((s, i) for s in range(3) for i in range(m)) * int(
            reads_data
        )
        assert r["peak"] == sim.peak_in_flight[pp_rank]
        sends = m * v - (m if pp_rank == pp - 1 else 0)
        assert r["freed"] == sends
    if tied:  # the first stage's embedding and the last stage's copy stay bit-identical
        for t in range(tp):
            first, last = results[t]["shared"], results[t + tp * (pp - 1)]["shared"]
            assert len(first) == len(last) == 1
            assert torch.equal(first[0], last[0])


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by name (`counts["mm"]`): how tests
    count kernels, host syncs or collectives' local ops without timing anything."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
