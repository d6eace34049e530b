"""megapipe's training step against Megatron-Core's, side by side, for TP=2, PP=2, DP=2 and TP=1.

Every rank (forked, gloo, one thread each) builds both steps for the same tiny GPT (2 layers,
hidden 128, 4 heads, seq 64, vocab 1024, rope, micro-batch 4, LayerNorm, GeLU MLP of 4h,
biases, tied embeddings, no dropout) and the same layout, then times them in alternating
rounds (all ranks start each block together after a barrier; rank 0's wall time per step, and
the busiest rank's CPU time per step, steadier on a machine shared with other jobs):

* megapipe: `megapipe.training.step.train_step` as pretrain_gpt.py builds it (GradBuffer,
  ShardedOptimizer with AdamW, clip-grad 1.0, weight decay 0.1, mock data);
* Megatron-Core 0.16: `GPTModel` (local layer spec: TransformerEngine is not installed) in its
  `DistributedDataParallel` with an fp32 gradient buffer, `get_forward_backward_func()` (1F1B
  when PP > 1), `finalize_model_grads`, and `get_megatron_optimizer` with Adam, clip-grad 1.0,
  weight decay 0.1 (torch's AdamW underneath: apex is not installed); and, as
  megatron/training/training.py's train_step does for the logged lm loss, the micro-batches'
  [loss sum, tokens] all-reduced over the data-parallel group (megapipe's step reduces its
  loss over DP too: `global_mean_loss`).

Megatron-Core asks for CUDA in a few places that matter nothing on the CPU; in the forked
ranks only, those calls are redirected to the CPU (`_cpu_only_megatron`). megapipe creates
nothing on "cuda" on a CPU machine, so the redirect does not touch its side. The two models
start from different random weights (each framework's own initialisation); both first losses
must be near ln(vocab), the same task. The headline per layout is the median over rounds of
megapipe's step time / Megatron-Core's (target <= 0.8).

    python benchmarks/bench_megatron_core.py                  # ~3 minutes on 2 cores
    python benchmarks/bench_megatron_core.py --layouts tp2 --rounds 5 --quick

Without megatron-core (`pip install -e .[bench]`) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_args import add_round_args, parse_round_args  # noqa: E402

from megapipe.atomic_files import write_json  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "megatron_core.json")
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO_BATCH = 2, 128, 4, 64, 1024, 4
# name: (tensor, pipeline, data parallel size, micro-batches per step)
LAYOUTS = {"tp1": (1, 1, 1, 1), "tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 4), "dp2": (1, 1, 2, 1)}


def _cpu_only_megatron() -> None:
    """Redirect Megatron-Core's hard-coded CUDA requests to the CPU (this process only)."""
    from megatron.core.tensor_parallel import random as mcore_random

    def on_cpu(factory):
        @functools.wraps(factory)
        def call(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return call

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):  # its clip_grads asserts "torch.cuda.FloatTensor"
        out = real_type(self, *args, **kwargs)
        if args or kwargs or ".cuda." in out:
            return out
        return out.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


class MegatronCoreStep:
    """Megatron-Core's training step (what megatron/training/training.py's train_step does)."""

    def __init__(self, tp: int, pp: int, micro_batches: int, seed: int) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(tp, pp)
        config = TransformerConfig(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            gradient_accumulation_fusion=False,  # a CUDA kernel
        )
        torch.manual_seed(seed)
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=True,  # Megatron-LM's (and megapipe's) default
            position_embedding_type="rope",
        )
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        self.model = DistributedDataParallel(config, ddp, model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-4, weight_decay=0.1, clip_grad=1.0,
                params_dtype=torch.float32,
            ),
            [self.model],
        )  # fmt: skip
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.forward_backward = get_forward_backward_func()
        self.micro_batches = micro_batches
        self.causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
        self.positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.generator = torch.Generator().manual_seed(seed + dp_rank)
        self.last_stage = parallel_state.is_pipeline_last_stage()

    def _batches(self):
        while True:
            seq = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=self.generator)
            yield seq[:, :-1], seq[:, 1:], torch.ones(MICRO_BATCH, SEQ)

    def _forward_step(self, data_iterator, model):
        tokens, labels, loss_mask = next(data_iterator)
        output = model(tokens, self.positions, self.causal, labels=labels)

        def loss_func(per_token):
            loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
            # pretrain_gpt.py's report: [loss sum, tokens], reduced over DP in train_step
            report = torch.stack([loss.detach() * loss_mask.sum(), loss_mask.sum()])
            return loss, {"lm loss": report}

        return output, loss_func

    def __call__(self) -> float:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self._batches(),
            model=[self.model],
            num_microbatches=self.micro_batches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        self.optimizer.step()
        if not self.last_stage:
            return math.nan
        # training.py's train_step: the micro-batches' [loss sum, tokens] summed, all-reduced
        # over the data-parallel group, divided (the logged lm loss)
        reported = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        torch.distributed.all_reduce(reported, group=self.dp_group)
        return float(reported[0] / reported[1])


def megapipe_flags(tp: int, pp: int, dp: int, micro_batches: int, seed: int) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
        "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
        "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(MICRO_BATCH * micro_batches * dp),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--mock-data", "--train-iters", "1000000", "--lr", "1e-4", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--position-embedding-type", "rope",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", str(seed),
    ]  # fmt: skip


def _rank(rank: int, world_size: int, layout: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from bench_step import MegapipeStep

    tp, pp, dp, micro_batches = LAYOUTS[layout]
    megapipe = MegapipeStep(megapipe_flags(tp, pp, dp, micro_batches, args.seed), world_size)
    _cpu_only_megatron()
    mcore = MegatronCoreStep(tp, pp, micro_batches, args.seed)
    steps = {"megapipe": megapipe, "megatron_core": mcore}
    first = {name: step() for name, step in steps.items()}
    for step in steps.values():
        for _ in range(args.warmup - 1):
            step()
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            dist.barrier()
            wall, cpu = [], []
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                steps[name]()
                wall.append((time.perf_counter() - start) * 1e3)
                cpu.append((time.process_time() - start_cpu) * 1e3)
            row[f"{name}_ms"] = statistics.median(wall)
            row[f"{name}_cpu_ms"] = statistics.median(cpu)
        rounds.append(row)
    return {"rank": rank, "first_loss": first, "rounds": rounds}


def run_layout(layout: str, args: argparse.Namespace) -> dict:
    from megapipe.testing import run_distributed

    tp, pp, dp, micro_batches = LAYOUTS[layout]
    per_rank = run_distributed(_rank, tp * pp * dp, layout, args, timeout=3600)
    rounds = per_rank[0]["rounds"]
    for i, r in enumerate(rounds):
        r["ratio"] = r["megapipe_ms"] / r["megatron_core_ms"]
        # the busiest rank's CPU time per step: the work, without the time other processes
        # held the cores (nor the waits in collectives)
        busiest = {
            n: max(p["rounds"][i][f"{n}_cpu_ms"] for p in per_rank)
            for n in ("megapipe", "megatron_core")
        }
        r["cpu_ratio"] = busiest["megapipe"] / busiest["megatron_core"]
    ratios = [r["ratio"] for r in rounds]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    last = per_rank[-1]["first_loss"]  # the last rank is on the last stage
    ln_vocab = math.log(VOCAB)
    for name, loss in last.items():
        if abs(loss - ln_vocab) > 0.05 * ln_vocab:
            raise SystemExit(f"{layout}: {name}'s first loss {loss:.4f} is far from ln(vocab)")
    return {
        "layout": layout,
        "tp_pp_dp_microbatches": LAYOUTS[layout],
        "first_loss": last,
        "rounds": rounds,
        "median_ms": {
            name: statistics.median(r[f"{name}_ms"] for r in rounds)
            for name in ("megapipe", "megatron_core")
        },
        "median_ratio": statistics.median(ratios),
        "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds),
        "ratio_quartiles": [q1, q3],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--seed", type=int, default=1234)
    add_round_args(p, warmup=3, rounds=12, steps=3, default_json=DEFAULT_JSON)
    return parse_round_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        print(
            f"bench_megatron_core: megatron-core is not importable ({error}); install the "
            "bench extra (pip install -e '.[bench]') to run this benchmark. Nothing measured."
        )
        return 0
    import warnings

    warnings.filterwarnings("ignore")  # Megatron-Core's "apex/TE not installed" notes
    print(
        f"megapipe vs Megatron-Core {megatron.core.__version__} training step: torch "
        f"{torch.__version__}, {platform.machine()} ({os.cpu_count()} cpus), one thread per "
        f"rank, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"model: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, "
        f"rope, micro-batch {MICRO_BATCH}; {args.rounds} alternating rounds x {args.steps} "
        "steps, rank 0's wall time\n"
    )
    results = []
    print(
        f"{'layout':>6}  {'megapipe ms':>11}  {'mcore ms':>9}  {'ratio':>6}  {'IQR':>11}  "
        f"{'cpu ratio':>9}  target (wall ratio)"
    )
    for layout in args.layouts:
        res = run_layout(layout, args)
        results.append(res)
        med, (q1, q3) = res["median_ms"], res["ratio_quartiles"]
        met = "met" if res["median_ratio"] <= 0.8 else "NOT met"
        print(
            f"{layout:>6}  {med['megapipe']:>11.2f}  {med['megatron_core']:>9.2f}  "
            f"{res['median_ratio']:>6.3f}  {q1:.3f}-{q3:.3f}  {res['median_cpu_ratio']:>9.3f}  "
            f"<= 0.8 {met}",
            flush=True,
        )
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "megatron_core",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "megatron_core": megatron.core.__version__,
                "config": {k: v for k, v in vars(args).items() if k != "json"},
                "layouts": results,
                "target": 0.8,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
