"""Small, real PyTorch trainings with a known fate, instrumented with the TrainGuard SDK.

    python -m trainguard_server.demo.trainings healthy|diverging|crashing|stalling [--steps N]
    python -m trainguard_server.demo.trainings canary --seed S [--lr LR] [--raise-at STEP]
                                                      [--extra-memory-mb MB] [--data-delay-ms MS]
                                                      [--tag K=V ...]

- healthy: the loss falls, the process exits 0;
- diverging: a learning-rate schedule bug multiplies the LR from mid-run on until the loss is NaN;
- crashing: a malformed batch from the data pipeline raises in the forward pass (exit code 1);
- stalling: from mid-run on, the data pipeline blocks forever (a hung NFS read, a deadlocked worker):
  the process is alive and heartbeating but makes no progress, until something kills it.
- canary: a short healthy training whose loss curve, step time and memory depend only on ``--seed`` (the
  CI gate's canary, see trainguard_server.gate); ``--lr`` changes the learning rate (an LR regression),
  ``--raise-at`` makes a "code change" raise a new exception at that step, ``--extra-memory-mb`` keeps that
  much more memory alive for the whole run (a memory regression), ``--data-delay-ms`` makes every batch
  arrive that much later (a slower data pipeline: a step-time regression). It reports process RSS every 10
  steps (``mem/rss``, the SDK's CPU memory metric) and the SDK's ``time/step_s``.

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

KINDS = ("healthy", "diverging", "crashing", "stalling", "canary")
CANARY_LR = 0.05


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


def _new_feature(x: torch.Tensor) -> torch.Tensor:
    """The "code change" of a canary with ``--raise-at``: a reshape that does not fit the batch."""
    return x.reshape(-1, 17)


def canary(steps: int, seed: int, lr: float = CANARY_LR, raise_at: int = -1, extra_memory_mb: int = 0,
           tags: dict[str, str] | None = None, step_sleep: float = 0.0, data_delay_ms: float = 0.0) -> None:
    """The CI gate's canary: the demo MLP trained for ``steps`` steps from ``seed`` (weights and data).
    Healthy with the defaults; see the module docstring for the regressions it can simulate. One intra-op
    thread: the same numbers on any machine, and steps that do not fight the backend for the cores."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(10_000 + seed)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trainguard.init(run_name=f"canary-seed{seed}", tags={"kind": "canary", "seed": str(seed), **(tags or {})},
                    config={"lr": lr, "seed": seed, "steps": steps}, memory_every=10)
    trainguard.watch(model, optimizer, clip=5.0)
    # a memory regression: a buffer alive for the whole run (written, so the pages are resident)
    ballast = torch.ones(extra_memory_mb * (1 << 18)) if extra_memory_mb > 0 else None
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = _batch(generator)
        if data_delay_ms > 0:
            time.sleep(data_delay_ms / 1000.0)  # the batch arrives later: inside the SDK's time/step_s
        if step == raise_at:
            x = _new_feature(x)  # raises: the new code path does not fit the batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        trainguard.log(step=step, loss=loss, lr=lr)
        if step_sleep:
            time.sleep(step_sleep)
    del ballast


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--tag wants KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    canary_flags = parser.add_argument_group("canary only")
    canary_flags.add_argument("--seed", type=int, default=0, help="weights and data seed")
    canary_flags.add_argument("--lr", type=float, default=CANARY_LR, help=f"learning rate ({CANARY_LR})")
    canary_flags.add_argument("--raise-at", type=int, default=-1, help="step at which new code raises")
    canary_flags.add_argument("--extra-memory-mb", type=int, default=0, help="memory kept alive (MiB)")
    canary_flags.add_argument("--data-delay-ms", type=float, default=0.0,
                              help="extra time for every batch to arrive (ms)")
    canary_flags.add_argument("--tag", type=_tag, action="append", default=[], help="run tag KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.kind == "canary":
        canary(args.steps, args.seed, lr=args.lr, raise_at=args.raise_at,
               extra_memory_mb=args.extra_memory_mb, tags=dict(args.tag), step_sleep=args.step_sleep,
               data_delay_ms=args.data_delay_ms)
    else:
        train(args.kind, args.steps, args.step_sleep)


if __name__ == "__main__":
    main()
