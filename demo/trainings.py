"""Small, real PyTorch trainings with a known fate, instrumented with the TrainGuard SDK.

    python -m demo.trainings healthy|diverging|crashing [--steps N]

The SDK is configured from the environment (TRAINGUARD_ENDPOINT, ...), exactly as a user's job would be.
Used by the demo and by the tests as real training runs.
"""

from __future__ import annotations

import argparse
import sys

import torch
import trainguard
from torch import nn


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _batch(generator: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True) * 0.5).tanh()
    return x, y


def train(kind: str, steps: int) -> None:
    """Train an MLP; ``kind`` decides how it ends (see module docstring)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = _model()
    lr = {"healthy": 0.05, "diverging": 0.05, "crashing": 0.05}[kind]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trainguard.init(project="demo", run_name=f"demo-{kind}", tags={"kind": kind})
    trainguard.watch(model, optimizer, clip=5.0)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = _batch(generator)
        if kind == "diverging" and step >= steps // 2:
            # a learning-rate schedule bug: the LR is multiplied instead of decayed
            for group in optimizer.param_groups:
                group["lr"] *= 3.0
        if kind == "crashing" and step == steps // 2:
            x = torch.randn(64, 15)  # a malformed batch from the data pipeline
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        trainguard.log(step=step, loss=loss, lr=optimizer.param_groups[0]["lr"])
        if kind == "diverging" and not torch.isfinite(loss):
            print(f"loss is {loss.item()} at step {step}; stopping", file=sys.stderr)
            break


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["healthy", "diverging", "crashing"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    train(args.kind, args.steps)


if __name__ == "__main__":
    main()
