"""Memory scenario trainings on CPU: small, real, seeded PyTorch runs whose memory really goes wrong in one
known way, instrumented with the TrainGuard SDK exactly like :mod:`tests.scenarios.trainings` (same CLI,
same helpers, ``trainguard.init()`` configured from the environment)::

    python -m tests.scenarios.trainings_memory <scenario> [--seed N] [--debug]

Nothing is injected: the anomaly is a bug in the training loop itself.

=================  =====================================================================================
scenario           what really happens
=================  =====================================================================================
leak               MLP regression (AdamW, warmup + cosine, clip 1.0) that also tracks its loss on a fixed
                   held-out batch every step "for a smoothed validation curve": the monitoring forward
                   runs outside ``torch.no_grad()`` and is summed as a tensor
                   (``monitor_total = monitor_total + val_loss``, no ``.item()``), so every step's
                   monitoring graph -- with the activations it saved for a backward that never comes --
                   stays reachable from ``monitor_total``. Host RSS grows by ~1.8 MB per step
                   (the saved activations of a 256-row batch through two 512-wide layers). The run calls
                   ``watch(..., memory_every=3)``: on CPU the SDK reports RSS only at those steps, and the
                   default 50 would give this 100-step run 3 samples.
=================  =====================================================================================
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import trainguard
from tests.scenarios.trainings import _mlp, _set_lr, _step, _warmup_cosine, scenario_args

SCENARIOS = ("leak",)
MEMORY_EVERY = 3
"""watch()'s memory_every in these runs: RSS samples often enough for a < 1 min run to show a trend."""

_DEBUG = False


def _start(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, clip: Optional[float] = None,
           memory_every: int = MEMORY_EVERY) -> None:
    """As :func:`tests.scenarios.trainings._start` (init from the environment, then watch), with
    ``memory_every`` passed to watch like a user who wants memory samples more often than every 50 steps."""
    torch.set_num_threads(1)
    trainguard.init(run_name=f"scenario-{name}", tags={"scenario": name})
    trainguard.watch(model, optimizer, clip=clip, memory_every=memory_every)


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * 4096 / 2**20
    except OSError:
        return float("nan")


def leak(steps: int = 100, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(11 + 1000 * seed)
    teacher = _mlp([64, 64, 1], nn.Tanh)
    model = _mlp([64, 512, 512, 1], nn.ReLU)
    x_val = torch.randn(256, 64, generator=gen)  # a fixed held-out batch, "to watch generalisation"
    with torch.no_grad():
        y_val = teacher(x_val)
    base_lr = 2e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=1e-2)
    _start("leak", model, optimizer, clip=1.0)
    monitor_total: torch.Tensor | float = 0.0
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 10, steps))
        x = torch.randn(64, 64, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.05 * torch.randn(64, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step, clip=1.0)
        # the bug: no torch.no_grad() and no .item() -- the graph of every monitoring pass stays alive
        val_loss = nn.functional.mse_loss(model(x_val), y_val)
        monitor_total = monitor_total + val_loss
        if _DEBUG:
            smoothed = float(torch.as_tensor(monitor_total).detach()) / (step + 1)
            print(f"{step:4d} loss {loss.item():.5f} val {val_loss.item():.5f} smoothed {smoothed:.5f} "
                  f"rss {_rss_mb():.1f} MB", file=sys.stderr)


RUNNERS: Dict[str, Callable[..., None]] = {"leak": leak}


def main(argv: Optional[List[str]] = None) -> None:
    global _DEBUG
    args = scenario_args(__doc__, SCENARIOS, "print loss, validation loss and RSS per step", argv)
    _DEBUG = args.debug
    RUNNERS[args.scenario](seed=args.seed)


if __name__ == "__main__":
    main()
