"""Scenario trainings: small, real, seeded PyTorch runs whose loss and gradient dynamics really go wrong
in one known way (or do not go wrong at all), instrumented with the TrainGuard SDK exactly like a user's
job: ``trainguard.init()`` configured from the environment, ``trainguard.watch(model, optimizer, clip=...)``
and ``trainguard.log(step=..., loss=..., lr=...)`` after each optimizer step.

    python -m tests.scenarios.trainings <scenario> [--debug]

Nothing is injected: every anomaly comes from the training itself (a learning rate, a schedule, an
initialisation, a clip threshold or a bad sample in the data). Each run is CPU-only, seeded, and takes a
few seconds. ``--debug`` prints loss, global gradient norm and LR per step (computed beside the SDK, for
people tuning a scenario; the SDK path is the same with or without it).

=================  =====================================================================================
scenario           what really happens
=================  =====================================================================================
healthy_mlp        MLP regression on a fixed random teacher + label noise; AdamW, linear warmup then
                   cosine decay, clip 1.0. Loss falls, then flattens near the noise floor.
healthy_lm         2-layer transformer LM on tokens from a fixed random Markov chain; AdamW, warmup,
                   cosine, clip 1.0. Cross-entropy falls from ln(V) towards the chain's entropy.
healthy_cnn        small CNN on random images labelled by a fixed random teacher (a linear read-out of the
                   pooled image); SGD + momentum, warmup, clip 5. Noisy, steadily falling loss.
oscillation        softmax regression (convex) on noisy Gaussian blobs with plain SGD at LR 25 (far too
                   high): every step overshoots, the loss swings violently at a high level, no trend.
rise_after_fall    MLP regression; Adam with a linear warmup to a peak LR of 1.0 (~300x too high): the loss
                   falls while the LR is small, then rebounds as the LR grows (the ReLUs die) and stays high.
plateau            one-hidden-layer ReLU regression net whose hidden biases were initialised to -10: every
                   ReLU is dead from the start, the hidden layer's gradient is exactly 0, only the output
                   bias learns (the target's mean, ~0): the loss sits at the target's variance.
explosion          MLP regression with SGD and a schedule bug (``ExponentialLR(gamma=1.03)`` instead of
                   0.97): the LR grows 3% per step; the loss falls, then the gradient norm climbs for tens of
                   steps until the loss is Inf/NaN. The loop stops at the first non-finite loss.
vanishing          20-layer sigmoid MLP (default init), SGD; per-layer norms every step: the first layers'
                   gradients are > 1000x smaller than the last layers'.
clip_stale         MLP regression with SGD and ``clip_grad_norm_(max_norm=0.01)`` where the gradient norm
                   is ~0.5: every step is clipped to a sliver and the loss barely moves.
nan_source         regression on log-targets (MSLE-style) from a dataset with one corrupted row whose target
                   is 0: the batch holding it computes log(0) = -Inf, the loss and every gradient become
                   non-finite at that step (no climb before). The loop goes on 1 step, then stops.
                   Per-layer norms every step (``watch(every=1)``), as when hunting a NaN.
=================  =====================================================================================
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import trainguard

HEALTHY = ("healthy_mlp", "healthy_lm", "healthy_cnn")
ANOMALOUS = ("oscillation", "rise_after_fall", "plateau", "explosion", "vanishing", "clip_stale",
             "nan_source")
SCENARIOS = HEALTHY + ANOMALOUS

_DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))
_STEP_SECONDS = float(os.environ.get("SCENARIO_STEP_SECONDS") or 0.0)
"""Seconds to sleep after each step (``$SCENARIO_STEP_SECONDS``): a live benchmark gives a toy step the
length a real one has relative to the SDK's flush interval."""


def _start(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, clip: Optional[float] = None,
           every: Optional[int] = None) -> None:
    """What a user adds to a training script: init (endpoint, project, ... from the environment), watch."""
    torch.set_num_threads(1)
    trainguard.init(run_name=f"scenario-{name}", tags={"scenario": name})
    trainguard.watch(model, optimizer, clip=clip, every=every)


def _debug(step: int, loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not _DEBUG:
        return
    with torch.no_grad():
        norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        total = torch.stack(norms).norm().item() if norms else float("nan")
    print(f"{step:4d} loss {loss.item():.6g} grad {total:.4g} lr {optimizer.param_groups[0]['lr']:.4g}",
          file=sys.stderr)


def _warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, step: int,
          clip: Optional[float] = None) -> None:
    """One iteration of the usual loop: backward, (clip), optimizer step, log."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    _debug(step, loss, model, optimizer)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip)
    optimizer.step()
    trainguard.log(step=step, loss=loss, lr=optimizer.param_groups[0]["lr"])
    if _STEP_SECONDS:
        time.sleep(_STEP_SECONDS)  # pacing for live measurements (bench/detection.py); dynamics unchanged


def _mlp(sizes: List[int], act: Callable[[], nn.Module]) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


# --- healthy runs ------------------------------------------------------------------------------------
def healthy_mlp(steps: int = 130, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1 + 1000 * seed)
    teacher = _mlp([32, 64, 1], nn.Tanh)
    model = _mlp([32, 128, 128, 1], nn.ReLU)
    base_lr = 3e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=1e-2)
    _start("healthy_mlp", model, optimizer, clip=1.0)
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 15, steps))
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(64, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step, clip=1.0)


class TinyLM(nn.Module):
    """A 2-layer causal transformer language model."""

    def __init__(self, vocab: int, context: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def _markov_tokens(transitions: torch.Tensor, batch: int, length: int, gen: torch.Generator
                   ) -> torch.Tensor:
    vocab = transitions.shape[0]
    out = torch.empty(batch, length, dtype=torch.long)
    out[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    for t in range(1, length):
        out[:, t] = torch.multinomial(transitions[out[:, t - 1]], 1, generator=gen).squeeze(1)
    return out


def healthy_lm(steps: int = 120, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(2 + 1000 * seed)
    vocab, context = 48, 33
    # a fixed random Markov chain: each token is followed by one of 3 tokens (entropy ~1 nat)
    transitions = torch.zeros(vocab, vocab)
    for v in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:3]
        transitions[v, nxt] = torch.tensor([0.6, 0.3, 0.1])
    model = TinyLM(vocab, context - 1)
    base_lr = 3e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.01)
    _start("healthy_lm", model, optimizer, clip=1.0)
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 20, steps))
        tokens = _markov_tokens(transitions, 16, context, gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        _step(model, optimizer, loss, step, clip=1.0)


def _cnn(channels: int, classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * 16, classes))


def healthy_cnn(steps: int = 120, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(3 + 1000 * seed)
    classes = 10
    # the labelling teacher: a fixed random linear read-out of the image's coarse (4x4-pooled) structure
    teacher = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(16, classes))
    with torch.no_grad():  # centre the teacher's logits so that its labels use every class
        probe = torch.randn(2048, 1, 16, 16, generator=gen)
        centre = teacher(probe).mean(dim=0)
    model = _cnn(16, classes)
    base_lr = 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9)
    _start("healthy_cnn", model, optimizer, clip=5.0)
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 10, steps))
        x = torch.randn(64, 1, 16, 16, generator=gen)
        with torch.no_grad():
            y = (teacher(x) - centre).argmax(dim=1)
        loss = nn.functional.cross_entropy(model(x), y)
        _step(model, optimizer, loss, step, clip=5.0)


# --- loss non-convergence ------------------------------------------------------------------------------
def _blobs(gen: torch.Generator, classes: int = 4, dim: int = 20, noise: float = 0.1
           ) -> Callable[[int], Tuple[torch.Tensor, torch.Tensor]]:
    centres = torch.randn(classes, dim, generator=gen) * 1.5

    def batch(size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(classes, (size,), generator=gen)
        x = centres[y] + torch.randn(size, dim, generator=gen)
        flip = torch.rand(size, generator=gen) < noise
        y = torch.where(flip, torch.randint(classes, (size,), generator=gen), y)
        return x, y

    return batch


def oscillation(steps: int = 120, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(4 + 1000 * seed)
    batch = _blobs(gen)
    model = nn.Linear(20, 4)  # softmax regression: a convex problem
    optimizer = torch.optim.SGD(model.parameters(), lr=25.0)  # far too high
    _start("oscillation", model, optimizer)
    for step in range(steps):
        x, y = batch(32)
        loss = nn.functional.cross_entropy(model(x), y)
        _step(model, optimizer, loss, step)


def rise_after_fall(steps: int = 130, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(5 + 1000 * seed)
    teacher = _mlp([16, 32, 1], nn.Tanh)
    model = _mlp([16, 64, 64, 1], nn.ReLU)
    peak, warmup = 1.0, 100  # a peak LR ~300x what Adam tolerates here (1e-3 .. 3e-3 would do)
    optimizer = torch.optim.Adam(model.parameters(), lr=peak / warmup)
    _start("rise_after_fall", model, optimizer)
    for step in range(steps):
        _set_lr(optimizer, peak * min(1.0, (step + 1) / warmup))
        x = torch.randn(128, 16, generator=gen)
        with torch.no_grad():
            y = 2 * teacher(x) + 0.05 * torch.randn(128, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step)


def plateau(steps: int = 130, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(6 + 1000 * seed)
    teacher = nn.Linear(16, 1)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
    with torch.no_grad():  # a bad initialisation: every hidden ReLU is dead from the first step
        model[0].bias.fill_(-10.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _start("plateau", model, optimizer)
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step)


# --- gradients -----------------------------------------------------------------------------------------
def explosion(steps: int = 160, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(7 + 1000 * seed)
    teacher = _mlp([16, 32, 1], nn.Tanh)
    model = _mlp([16, 64, 64, 1], nn.ReLU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=1.03)  # bug: meant 0.97
    _start("explosion", model, optimizer)
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.05 * torch.randn(64, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step)
        scheduler.step()
        if not torch.isfinite(loss):
            print(f"loss is {loss.item()} at step {step}; stopping", file=sys.stderr)
            break


def vanishing(steps: int = 40, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(8 + 1000 * seed)
    teacher = nn.Linear(16, 1)
    model = _mlp([16] + [32] * 19 + [1], nn.Sigmoid)  # 20 Linear layers, sigmoid between them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _start("vanishing", model, optimizer, every=1)
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step)


def clip_stale(steps: int = 80, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(9 + 1000 * seed)
    teacher = _mlp([16, 32, 1], nn.Tanh)
    model = _mlp([16, 64, 64, 1], nn.ReLU)
    clip = 0.01  # far too low: the gradient norm is ~0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _start("clip_stale", model, optimizer, clip=clip)
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            y = 2 * teacher(x) + 0.05 * torch.randn(64, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        _step(model, optimizer, loss, step, clip=clip)


def _log_target_data(gen: torch.Generator, rows: int = 2048) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, 16, generator=gen)
    y = torch.exp(0.5 * x[:, :4].sum(dim=1, keepdim=True) / 2) * (1 + 0.05 * torch.randn(rows, 1, generator=gen))
    y[1234] = 0.0  # one corrupted row (a sensor dropout written as 0) among 2048
    return x, y


def _batches(x: torch.Tensor, y: torch.Tensor, size: int, gen: torch.Generator
             ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    while True:
        order = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0] - size + 1, size):
            idx = order[i:i + size]
            yield x[idx], y[idx]


def nan_source(steps: int = 120, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10 + 1000 * seed)
    x_all, y_all = _log_target_data(gen)
    model = _mlp([16, 64, 64, 1], nn.ReLU)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _start("nan_source", model, optimizer, clip=10.0, every=1)
    bad_since: Optional[int] = None
    for step, (x, y) in zip(range(steps), _batches(x_all, y_all, 32, gen)):
        loss = nn.functional.mse_loss(model(x), torch.log(y))  # log(0) for the corrupted row
        _step(model, optimizer, loss, step, clip=10.0)
        if bad_since is None and not torch.isfinite(loss):
            bad_since = step
            print(f"loss is {loss.item()} at step {step}", file=sys.stderr)
        if bad_since is not None and step >= bad_since + 1:
            break


RUNNERS: Dict[str, Callable[..., None]] = {
    "healthy_mlp": healthy_mlp, "healthy_lm": healthy_lm, "healthy_cnn": healthy_cnn,
    "oscillation": oscillation, "rise_after_fall": rise_after_fall, "plateau": plateau,
    "explosion": explosion, "vanishing": vanishing, "clip_stale": clip_stale, "nan_source": nan_source,
}


def scenario_args(doc: Optional[str], names: Sequence[str], debug_help: str,
                  argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line every scenario module takes: ``<scenario> [--debug] [--seed N]``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=names)
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed offset (0: the recorded streams; others: the same training, other draws)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    global _DEBUG
    args = scenario_args(__doc__, SCENARIOS, "print loss, grad norm and LR per step", argv)
    _DEBUG = _DEBUG or args.debug
    RUNNERS[args.scenario](seed=args.seed)


if __name__ == "__main__":
    main()
