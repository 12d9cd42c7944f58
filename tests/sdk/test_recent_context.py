"""The context written ahead with an alert holds every value logged before it, wherever the worker is.

The worker pops a batch from the queue, reads it back and only then folds its values into the recent
history; a context read in between used to miss the whole batch (the CI flake of test_hard_death's SIGKILL
case: the NaN alert's recent loss steps ended one worker batch early). Here the worker is held exactly there.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

import trainguard
import trainguard.client as client_mod
from trainguard.guard import reset_warnings


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


class _HeldReadBack:
    """client.read_back that, once armed, holds the worker between popping a batch and folding it."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self._real = client_mod.read_back

    def __call__(self, items: List[Tuple[Any, ...]]) -> List[Tuple[Any, ...]]:
        if self.armed and items:
            self.armed = False
            self.entered.set()
            self.release.wait(10)
        return self._real(items)


def _held_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tuple[_HeldReadBack, Any]:
    """A client (file endpoint, 32 recent values a metric) whose worker can be held in read_back."""
    held = _HeldReadBack()
    monkeypatch.setattr(client_mod, "read_back", held)
    trainguard.init(endpoint=f"file://{tmp_path / 'events.jsonl'}", project="t", spool_dir="",
                    capture_exit=False, capture_uncaught=False, recent_metrics=32)
    client = trainguard.get_client()
    assert client is not None
    return held, client


def _loss_steps(recent: List[Tuple[str, int, float]]) -> List[int]:
    return [step for name, step, _ in recent if name == "loss"]


def test_values_the_worker_holds_between_pop_and_fold_are_in_the_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held, client = _held_client(tmp_path, monkeypatch)
    for step in range(10):
        trainguard.log(step=step, loss=1.0 / (step + 1))
    assert trainguard.flush(5)
    assert _loss_steps(client.recent_metrics()) == list(range(10))

    held.armed = True
    for step in range(10, 20):
        trainguard.log(step=step, loss=1.0 / (step + 1))
    trainguard.flush(0.0)  # wakes the worker
    assert held.entered.wait(10), "the worker never drained the second batch"
    try:
        # the worker holds some of steps 10-19 (popped, not folded); the rest are still queued
        assert max(_loss_steps(client.recent_metrics())) == 9
        assert _loss_steps(client._recent_so_far()) == list(range(20))
    finally:
        held.release.set()
    assert trainguard.flush(5)
    # folded now: each value once, not once from the history and again from the batch that was in hand
    assert _loss_steps(client._recent_so_far()) == list(range(20))
    assert _loss_steps(client.recent_metrics()) == list(range(20))


def test_a_value_logged_again_at_the_same_step_is_kept_each_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The context is the history's own record wherever the values are (an lr logged per micro-batch, or
    every value of a loop that never sets a step, repeats (step, value)): no value merged away."""
    held, client = _held_client(tmp_path, monkeypatch)
    for _ in range(3):
        trainguard.log(step=7, lr=0.1)
    assert trainguard.flush(5)
    held.armed = True
    for _ in range(3):
        trainguard.log(step=8, lr=0.1)
    trainguard.flush(0.0)
    assert held.entered.wait(10), "the worker never drained the second batch"
    try:
        lr = [(step, value) for name, step, value in client._recent_so_far() if name == "lr"]
        assert lr == [(7, 0.1)] * 3 + [(8, 0.1)] * 3
    finally:
        held.release.set()
    assert trainguard.flush(5)
    assert client._recent_so_far() == client.recent_metrics()
    assert [(step, value) for name, step, value in client.recent_metrics() if name == "lr"] == \
        [(7, 0.1)] * 3 + [(8, 0.1)] * 3
