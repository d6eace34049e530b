"""Pipeline a plain nn.Sequential (a small convolutional classifier, not a GPT) with
megapipe.pipeline.Pipe, and check it against the same model trained unpipelined.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/pipe_sequential.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 examples/pipe_sequential.py \
        --balance time --schedule gpipe

Every rank builds the whole model from the same seed; Pipe keeps each rank's stage. The last
stage prints the loss of each step, and at the end the losses of the same training run
without a pipeline (computed there too), which they should equal to float rounding.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from megapipe.pipeline import Pipe


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic 16x16 noisy 'images' of class c, whose row c is a little brighter."""
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        y = torch.randint(0, 10, (batch,), generator=generator)
        x = torch.randn(batch, 1, 16, 16, generator=generator)
        x[torch.arange(batch), 0, y, :] += 1.0
        data.append((x, y))
    return data


def unpipelined_losses(data, chunks: int, lr: float) -> list[float]:
    """The same training without a pipeline: each batch's mean micro-batch loss, Adam."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        parts = zip(x.chunk(chunks), y.chunk(chunks))
        loss = torch.stack([nn.functional.cross_entropy(model(a), b) for a, b in parts]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--balance", default="uniform", help="uniform, time, memory or 3,2,4")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved-1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    owns_group = not dist.is_initialized()  # torchrun: join its world
    if owns_group:
        dist.init_process_group("gloo")
    balance = args.balance
    if balance[0].isdigit():
        balance = [int(n) for n in balance.split(",")]
    data = make_data(args.steps, args.batch)
    pipe = Pipe(
        make_model(),
        chunks=args.chunks,
        sample_input=data[0][0],
        loss_fn=nn.functional.cross_entropy,
        balance=balance,
        schedule=args.schedule,
        virtual_stages=2 if args.schedule == "interleaved-1f1b" else 1,
    )
    print(f"rank {dist.get_rank()}: modules {sorted(pipe.local_modules)}", flush=True)
    params = pipe.parameters()  # a stage of parameter-free modules (ReLU, pooling) has none
    optimizer = torch.optim.Adam(params, lr=args.lr) if params else None
    losses = []
    for step, (x, y) in enumerate(data):
        loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
            print(f"step {step + 1:3d} | loss {loss.item():.6f}", flush=True)
    if pipe.is_last_stage:
        reference = unpipelined_losses(data, args.chunks, args.lr)
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"unpipelined: first loss {reference[0]:.6f}, last {reference[-1]:.6f}")
        print(f"largest difference from the unpipelined run: {worst:.2e}", flush=True)
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
