"""The plateau rule's block slope from kept block medians (issue 15, stop 41): the Theil-Sen slope through the
medians of the window's blocks of 4 values is taken from block medians kept beside the loss tail by the index
of the block's first point (``loss._kept_block_slope``), so a window that moved on by a multiple of 4 points
(an open plateau refreshed every ``loss_window // 4`` values, every second time) takes only its new blocks.
It must change nothing: on every call an oracle takes ``_block_slope`` of the window's step and value lists
and the two must be the same float, bit for bit, on every corpus scenario, on the synthetic threshold streams
(late points, replays, trims, non-finite values) and on long open plateaus (the refresh path), delivered in
pieces with snapshot restores; and the outputs and snapshots equal those of a pipeline that builds the lists
and takes every block on each call, piece by piece."""

from __future__ import annotations

import math
import struct
from typing import Any, ContextManager, Dict, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import SMALL_HISTORY, VARIANTS, _events_of, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss

PURE = pytest.mark.engine_pure("replaces loss._kept_block_slope and _Window.slope_bound")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]


def _listed(tail: Any, width: int) -> float:
    """The slope as the rule took it before: from the window's step and value lists, every block anew."""
    window = tail.points[-width:]
    return loss._block_slope([s for s, _v, _t in window], [v for _s, v, _t in window])


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class _Oracle:
    def __init__(self) -> None:
        self.saved = loss._kept_block_slope
        self.calls = self.reused = 0
        self.failed: List[str] = []

    def __call__(self, tail: Any, width: int) -> float:
        kept = loss._derived(tail)
        start = len(tail.points) - width
        self.reused += sum(1 for at in range(start, len(tail.points) - 3, 4) if at in kept.blocks)
        answer = self.saved(tail, width)
        self.calls += 1
        truth = _listed(tail, width)
        if _bits(answer) != _bits(truth):
            self.failed.append(f"step {tail.points[-1][0]}: {answer!r} != {truth!r}")
        return answer

    def __enter__(self) -> _Oracle:
        loss._kept_block_slope = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._kept_block_slope = self.saved  # type: ignore[assignment]


def _slow() -> ContextManager[object]:
    """The block slope from the listed blocks on every refresh (the kept medians off)."""
    return patch.object(loss, "_kept_block_slope", _listed)


def _compare(events: List[Event], settings: DetectionSettings, piece: int = 37, restore_every: int = 3) -> _Oracle:
    oracle = _Oracle()
    run_fast_and_slow(events, settings, oracle, _slow, piece, restore_every)
    assert not oracle.failed, oracle.failed[:3]
    return oracle


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, SETTINGS)
    _compare(events, SMALL_HISTORY, piece=11, restore_every=2)


@pytest.mark.parametrize("seed", range(48))
def test_synthetic_threshold_streams_are_unchanged(seed: int) -> None:
    _compare(list(_loss_stream(seed)), VARIANTS[seed % len(VARIANTS)], piece=23 + seed % 5)


def _open_plateau(seed: int) -> List[float]:
    """A loss flat about its start for long (an open plateau, refreshed every loss_window // 4 values),
    with noise, ties (values repeated), a -0.0 / 0.0 pair in a few, a slow drift and at the end a step down
    (the plateau may clear)."""
    out: List[float] = []
    for k in range(700):
        v = 2.0 + 1e-3 * (((k * 7919 + seed * 31) % 13) - 6) + (seed % 3) * 1e-5 * k
        if seed % 4 == 1 and k % 5 == 0:
            v = 2.0  # ties
        out.append(v if k < 600 else 1.6 + 1e-3 * (k % 3))
    return out


@PURE
@pytest.mark.parametrize("seed", range(12))
def test_open_plateaus_refreshed_are_unchanged(seed: int) -> None:
    events = _events_of(_open_plateau(seed), f"flat-{seed}")
    settings = (SETTINGS, SMALL_HISTORY, VARIANTS[3])[seed % 3]
    # (with the slope's bound off: since stop 45 a refresh whose bound decides the size test takes no
    # slope -- tests/engine/test_loss_plateau_bounds.py -- and these flat plateaus would ask for few)
    with patch.object(loss._Window, "slope_bound", lambda win: math.inf):
        oracle = _compare(events, settings, piece=41 + seed)
    assert oracle.calls > 40 and oracle.reused > 4 * oracle.calls // 10, (oracle.calls, oracle.reused)


def test_the_kept_slope_is_the_listed_one_on_hand_made_windows() -> None:
    """Edge windows: ties across blocks, a flat window (no slope: 0.0), -0.0 and 0.0, a window moved on by
    1, 2, 3 and 4 points (each alignment of the blocks), huge and tiny values."""
    from trainguard_engine.state import SeriesTail

    for values in ([1.0] * 60, [0.0, -0.0] * 30, [(-1.0) ** k * 1e300 for k in range(60)],
                   [1e-300 * (k % 7) for k in range(60)], [float(k // 6) for k in range(60)],
                   [math.sin(k) for k in range(60)]):
        data = {}
        tail = SeriesTail(data)
        for step, v in enumerate(values):
            data[step] = (v, 0)
            tail.append(step, v, 0)
            for width in (8, 12, 40):
                if len(tail.points) >= width:
                    assert _bits(loss._kept_block_slope(tail, width)) == _bits(_listed(tail, width))
