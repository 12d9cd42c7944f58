"""Small, real PyTorch trainings with a known fate, instrumented with the TrainGuard SDK.

    python -m trainguard_server.demo.trainings healthy|diverging|crashing|stalling [--steps N]

- healthy: the loss falls, the process exits 0;
- diverging: a learning-rate schedule bug multiplies the LR from mid-run on until the loss is NaN;
- crashing: a malformed batch from the data pipeline raises in the forward pass (exit code 1);
- stalling: from mid-run on, the data pipeline blocks forever (a hung NFS read, a deadlocked worker):
  the process is alive and heartbeating but makes no progress, until something kills it.

The SDK is configured from the environment (TRAINGUARD_ENDPOINT, ...), exactly as a user's job would be.
Used by the demo and by the tests as real training runs.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch
from torch import nn

import trainguard

KINDS = ("healthy", "diverging", "crashing", "stalling")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _batch(generator: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True) * 0.5).tanh()
    return x, y


def train(kind: str, steps: int, step_sleep: float = 0.0) -> None:
    """Train an MLP; ``kind`` decides how it ends (see module docstring)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = _model()
    lr = 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trainguard.init(run_name=f"demo-{kind}", tags={"kind": kind})  # endpoint, token, project: env
    trainguard.watch(model, optimizer, clip=5.0)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = _batch(generator)
        if kind == "diverging" and step >= steps // 2:
            # a learning-rate schedule bug: the LR is multiplied instead of decayed
            for group in optimizer.param_groups:
                group["lr"] *= 1.5
        if kind == "crashing" and step == steps // 2:
            x = torch.randn(64, 15)  # a malformed batch from the data pipeline
        if kind == "stalling" and step == steps // 2:
            print(f"data pipeline blocked at step {step}", file=sys.stderr, flush=True)
            threading.Event().wait()  # blocks forever; heartbeats keep coming from the SDK's thread
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        trainguard.log(step=step, loss=loss, lr=optimizer.param_groups[0]["lr"])
        if step_sleep:
            time.sleep(step_sleep)  # pace the run so a person can watch it live
        if kind == "diverging" and not torch.isfinite(loss):
            print(f"loss is {loss.item()} at step {step}; stopping", file=sys.stderr)
            break


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args(argv)
    train(args.kind, args.steps, args.step_sleep)


if __name__ == "__main__":
    main()
