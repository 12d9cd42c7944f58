"""Process-level scenario trainings: small, real, seeded PyTorch runs that end the way jobs end in real life
-- a crash on a real bug, a real hang -- instrumented with the TrainGuard SDK exactly like
``tests/scenarios/trainings.py`` (its ``_start`` and ``_step``: ``trainguard.init()`` configured from the
environment, ``trainguard.watch()``, ``trainguard.log()`` after each optimizer step).

    python -m tests.scenarios.trainings_process <scenario> [--seed N] [--stall-limit S]

Nothing is injected: the crash is a bug in the training loop, the hang a deadlock between a thread and a
fork. CPU only, seeded, a few seconds (``stall``: until ``--stall-limit``).

=========  =========================================================================================
scenario   what really happens
=========  =========================================================================================
crash      CNN on 8x8 single-channel images stored flat (3000 rows of 64 features, as a feature store or
           a CSV gives them). The loop turns each batch into images with ``x.view(BATCH, 1, 8, 8)``, the
           batch size hard-coded; the DataLoader keeps the last, incomplete batch of the epoch
           (``drop_last=False``: 3000 = 93 x 32 + 24), whose 24 rows cannot be viewed as 32 images:
           ``RuntimeError: shape '[32, 1, 8, 8]' is invalid for input of size 1536`` after 93 good steps.
           Uncaught: the process prints the traceback and exits 1.
stall      MLP on a dataset that normalises each sample with per-feature statistics, read under the
           dataset's lock. At every epoch boundary a background thread of the main process refreshes
           those statistics, holding the lock while it recomputes them (robust statistics over
           augmented passes of the data; __getitem__ waits for the fresh values, by design). The
           DataLoader has 2 workers and (the default) no persistent workers, so the next epoch forks
           new workers -- while the refresh holds the lock. Each forked worker inherits a locked lock
           that no thread in it will ever release, blocks in its first __getitem__, and the training
           loop waits forever for the next batch (DataLoader's default ``timeout=0``; the workers are
           alive, so its liveness check never fires). The process stays alive and the SDK's heartbeat
           thread keeps running: a real hang after the last step of epoch 0.
=========  =========================================================================================

``stall`` never ends by itself. For recording (``tests/scenarios/record.py``) and the benchmark, a
watchdog thread bounds it: ``--stall-limit S`` (or ``SCENARIO_STALL_LIMIT_S``) sends the process SIGTERM
once no step has completed for S seconds -- what a scheduler's time limit or an operator does to a hung
job (the SDK reports the exit: code 143, SIGTERM). The workers ask the kernel to kill them when the main
process dies (``PR_SET_PDEATHSIG``), so a terminated run leaves no orphaned, deadlocked worker behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.scenarios.trainings import _mlp, _start, _step

SCENARIOS = ("crash", "stall")
STALL_LIMIT_ENV = "SCENARIO_STALL_LIMIT_S"


# --- crash -------------------------------------------------------------------------------------------------
BATCH = 32


def crash(seed: int = 0, epochs: int = 3) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(11 + 1000 * seed)
    rows, classes = 3000, 4  # 3000 = 93 x 32 + 24: the last batch of an epoch is incomplete
    flat = torch.randn(rows, 64, generator=gen)
    # labels from a fixed random linear read-out of the image's four 4x4 quadrant means
    quadrants = nn.functional.avg_pool2d(flat.view(rows, 1, 8, 8), 4).flatten(1)
    labels = (quadrants @ torch.randn(4, classes, generator=gen)).argmax(dim=1)
    loader = DataLoader(TensorDataset(flat, labels), batch_size=BATCH, shuffle=True, generator=gen)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(8 * 16, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    _start("crash", model, optimizer, clip=5.0)
    step = 0
    for _epoch in range(epochs):
        for x, y in loader:
            images = x.view(BATCH, 1, 8, 8)  # the bug: every batch is assumed to be full
            loss = nn.functional.cross_entropy(model(images), y)
            _step(model, optimizer, loss, step, clip=5.0)
            step += 1


# --- stall -------------------------------------------------------------------------------------------------
class NormalisedFeatures(Dataset[Tuple[torch.Tensor, torch.Tensor]]):
    """Rows normalised with per-feature statistics that a background thread refreshes between epochs;
    the statistics are read and written under ``self.lock``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y = x, y
        self.lock = threading.Lock()
        self.centre = torch.zeros(x.shape[1])
        self.scale = torch.ones(x.shape[1])
        self.seed = seed
        self.refreshes = 0

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        with self.lock:  # wait for fresh statistics rather than normalise with stale ones
            centre, scale = self.centre, self.scale
        return (self.x[i] - centre) / scale, self.y[i]

    def recompute_statistics(self, on_locked: Optional[Callable[[], None]] = None,
                             passes: int = 128) -> None:
        """Median and MAD per feature over ``passes`` augmented (jittered, rescaled) views of the data,
        holding the lock so that no batch is normalised with half-updated statistics (``on_locked`` is
        called once the lock is held)."""
        gen = torch.Generator().manual_seed(100 + self.seed * 1000 + self.refreshes)
        with self.lock:
            if on_locked is not None:
                on_locked()
            views = []
            for _ in range(passes):
                jitter = 0.05 * torch.randn(self.x.shape, generator=gen)
                gain = 1 + 0.1 * torch.randn(1, self.x.shape[1], generator=gen)
                views.append(self.x * gain + jitter)
            data = torch.cat(views)
            centre = data.median(dim=0).values
            scale = (data - centre).abs().median(dim=0).values * 1.4826 + 1e-6
            self.centre, self.scale = centre, scale
            self.refreshes += 1


class StatisticsRefresher:
    """Refreshes a dataset's statistics in a background thread so that training need not wait for it."""

    def __init__(self, dataset: NormalisedFeatures) -> None:
        self.dataset = dataset

    def refresh(self) -> None:
        """Start a refresh; return once it holds the lock (every batch from then on gets the new
        statistics)."""
        locked = threading.Event()
        threading.Thread(target=self.dataset.recompute_statistics, kwargs={"on_locked": locked.set},
                         name="stats-refresh", daemon=True).start()
        locked.wait()


def _die_with_parent(_worker_id: int) -> None:
    """DataLoader worker_init_fn: the kernel SIGKILLs this worker when the main process dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _arm_watchdog(limit_s: float, last_step: List[float]) -> None:
    """SIGTERM this process once no step has completed for ``limit_s`` seconds (a job's time limit)."""

    def watch() -> None:
        while True:
            time.sleep(0.1)
            idle = time.monotonic() - last_step[0]
            if idle > limit_s:
                print(f"watchdog: no step for {idle:.1f} s (limit {limit_s:g} s); sending SIGTERM",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="stall-watchdog", daemon=True).start()


def stall(seed: int = 0, epochs: int = 4, stall_limit: Optional[float] = None) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(12 + 1000 * seed)
    rows = 2048
    x = torch.randn(rows, 32, generator=gen) * 3 + 1
    teacher = _mlp([32, 32, 1], nn.Tanh)
    with torch.no_grad():
        y = teacher((x - 1) / 3) + 0.05 * torch.randn(rows, 1, generator=gen)
    dataset = NormalisedFeatures(x, y, seed)
    dataset.recompute_statistics()  # initial statistics, before any worker exists
    refresher = StatisticsRefresher(dataset)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, generator=gen,
                        worker_init_fn=_die_with_parent, multiprocessing_context="fork")
    model = _mlp([32, 64, 64, 1], nn.ReLU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _start("stall", model, optimizer, clip=1.0)
    last_step = [time.monotonic()]
    if stall_limit is not None:
        _arm_watchdog(stall_limit, last_step)
    step = 0
    for epoch in range(epochs):
        for xb, yb in loader:  # a new iterator per epoch: new worker processes are forked here
            loss = nn.functional.mse_loss(model(xb), yb)
            _step(model, optimizer, loss, step, clip=1.0)
            step += 1
            last_step[0] = time.monotonic()
        print(f"epoch {epoch} done at step {step - 1}; refreshing the normalisation statistics",
              file=sys.stderr, flush=True)
        refresher.refresh()


RUNNERS: Dict[str, Callable[..., None]] = {"crash": crash, "stall": stall}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed offset (0: the recorded streams; others: the same training, other draws)")
    parser.add_argument("--stall-limit", type=float, default=None,
                        help=f"stall: SIGTERM the process after this many seconds without a step (default: "
                             f"${STALL_LIMIT_ENV}, else never)")
    args = parser.parse_args(argv)
    if args.scenario == "stall":
        limit = args.stall_limit
        if limit is None and os.environ.get(STALL_LIMIT_ENV):
            limit = float(os.environ[STALL_LIMIT_ENV])
        stall(seed=args.seed, stall_limit=limit)
    else:
        RUNNERS[args.scenario](seed=args.seed)


if __name__ == "__main__":
    main()
