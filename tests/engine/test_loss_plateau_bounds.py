"""The plateau rule's size tests decided by bounds (issue 15, stop 45): on a verdict-only check (``explain``
False: an open plateau's refresh every few values, or a value that may start a streak) the rule needs only
"is the window's robust spread under the swing bar" and "is the Theil-Sen block slope's change over the
window at most plateau_max_change x its level". ``_Window.cv_under`` answers the first from the window's
range (no sorted deviations) and ``_Window.slope_bound`` bounds the slope from the kept blocks' value range
and smallest step gap (no pairwise slopes); where the bound does not decide, the exact figure is taken as
before. It must change nothing: every bound is checked against the exact figure on random windows (ties,
negative and mixed-sign values, constant windows, uneven and huge steps, late points), and pipelines with the
bounds on and off give the same outputs and snapshots piece by piece (restores) on open-plateau streams, the
synthetic loss streams of test_loss_quiet_stretch and the corpus scenarios."""

from __future__ import annotations

import math
import random
from typing import Any, List

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.engine.test_loss_quiet_stretch import VARIANTS, _events_of, _loss_stream
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.state import SeriesTail

PURE = pytest.mark.engine_pure("counts the plateau bounds' calls")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()


def _tail(rng: random.Random, n: int) -> SeriesTail:
    """A tail of ``n`` finite points in step order: steps 1 apart, or uneven gaps, or huge; values flat
    with noise, with ties, negative, mixed-sign, constant, or with an outlier."""
    kind = rng.choice(("flat", "ties", "negative", "mixed", "constant", "outlier", "trend"))
    gaps = rng.choice(("one", "uneven", "huge"))
    step = 10 ** 15 if gaps == "huge" else 0
    data = {}
    for k in range(n):
        step += 1 if gaps != "uneven" else rng.choice((1, 1, 2, 7))
        level = {"negative": -2.0, "mixed": 0.0}.get(kind, 2.5)
        noise = {"flat": 0.005, "ties": 0.0, "constant": 0.0}.get(kind, 0.3)
        value = level + noise * rng.gauss(0, 1)
        if kind == "ties":
            value = rng.choice((2.5, 2.5, 2.0, -0.0, 0.0))
        if kind == "outlier" and k == n // 2:
            value = 1e6
        if kind == "trend":
            value = 2.5 - 0.01 * k + 0.01 * rng.gauss(0, 1)
        data[step] = (value, k)
    return SeriesTail(data)


@pytest.mark.parametrize("seed", range(40))
def test_the_slope_bound_bounds_the_block_slope(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        width = rng.choice((8, 12, 24, 40, 41, 43))
        tail = _tail(rng, width + rng.randrange(0, 30))
        bound = loss._kept_block_slope_bound(tail, width)
        slope = loss._kept_block_slope(tail, width)
        assert abs(slope) <= bound, (bound, slope)
        # the same blocks kept either way: the bound, asked again after the slope, says the same
        assert loss._kept_block_slope_bound(tail, width) == bound


@pytest.mark.parametrize("seed", range(20))
def test_a_change_said_within_is_within(seed: int) -> None:
    """_change_within on random windows against the exact change, with limits about it (two blocks: the
    bound is the slope itself, so a limit a little under the change must not be said to hold)."""
    rng = random.Random(seed)
    said = refused = 0
    for _ in range(80):
        width = rng.choice((8, 8, 12, 40))
        tail = _tail(rng, width + rng.randrange(0, 6))
        win = loss._Window(tail.points, width, tail)
        first, last = win.first_step, win.last_step
        change = abs(loss._block_slope(win.steps, win.values)) * (last - first + 1)
        for limit in (change * 0.75, change * 0.999, change, change * 1.5, change * 10, 0.0):
            if loss._change_within(win, first, last, limit):
                said += 1
                assert not change > limit, (change, limit, width)
            else:
                refused += 1
    assert said > 0 and refused > 0


def test_cv_under_on_a_tight_window() -> None:
    """Half the values at median - d, half at median + d: every deviation is d, cv = MAD_TO_SIGMA x d /
    median exactly, the bound's own value -- a bar just over it is said, one at it is not."""
    values = [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0]
    tail = SeriesTail({k + 1: (v, k) for k, v in enumerate(values)})
    cv = loss._Window(tail.points, 8, tail).cv
    assert cv == 1.4826 * 1.0 / 2.0
    assert loss._Window(tail.points, 8, tail).cv_under(cv * 1.001)
    assert not loss._Window(tail.points, 8, tail).cv_under(cv)
    assert not loss._Window(tail.points, 8, tail).cv_under(cv * 0.7)


def test_the_slope_bound_is_not_proven_without_rising_steps() -> None:
    tail = SeriesTail({s: (2.0 + 0.1 * s, s) for s in range(1, 41)})
    assert loss._kept_block_slope_bound(tail, 40) < math.inf
    tail.points[5:9] = [(2, 2.0, 0)] * 4  # (a block whose step median repeats an earlier one)
    tail.windows.clear()
    assert loss._kept_block_slope_bound(tail, 40) == math.inf
    assert loss._kept_block_slope_bound(SeriesTail({1: (1.0, 0), 2: (2.0, 0)}), 2) == 0.0  # no block pair


@pytest.mark.parametrize("seed", range(40))
def test_cv_under_is_never_wrong(seed: int) -> None:
    rng = random.Random(seed)
    said = 0
    for _ in range(60):
        width = rng.choice((8, 24, 40))
        tail = _tail(rng, width + rng.randrange(0, 10))
        series = tail.points
        for bar in (0.0, 1e-4, 0.003, 0.01, 0.1, 0.3, 1.0, math.inf):
            win = loss._Window(series, width, tail)
            if win.cv_under(bar):
                said += 1
                assert win.cv < bar, (win.cv, bar)
            assert loss._Window(series, width, tail).cv == win.cv  # (asking it leaves cv as it was)
    assert said > 0


class _Bounds:
    """The two bounds counted, and checked on the window they are asked on where they decide."""

    def __init__(self) -> None:
        self.cv = loss._Window.cv_under
        self.slope = loss._Window.slope_bound
        self.decided = 0
        self.failed: List[str] = []

    def __enter__(self) -> _Bounds:
        outer = self

        def cv_under(win: Any, bar: float) -> bool:
            answer = outer.cv(win, bar)
            if answer:
                outer.decided += 1
                if not loss._Window(win._series, win._size).cv < bar:
                    outer.failed.append(f"cv {bar}")
            return answer

        def slope_bound(win: Any) -> float:
            bound = outer.slope(win)
            exact = loss._block_slope(loss._Window(win._series, win._size).steps,
                                      loss._Window(win._series, win._size).values)
            if not abs(exact) <= bound:
                outer.failed.append(f"slope {exact} > {bound}")
            return bound

        loss._Window.cv_under = cv_under  # type: ignore[method-assign]
        loss._Window.slope_bound = slope_bound  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        loss._Window.cv_under = self.cv  # type: ignore[method-assign]
        loss._Window.slope_bound = self.slope  # type: ignore[method-assign]


class _off:  # (the bounds never decide: the exact figures, as before)
    def __enter__(self) -> None:
        self.saved = (loss._Window.cv_under, loss._Window.slope_bound)
        loss._Window.cv_under = lambda win, bar: False  # type: ignore[method-assign]
        loss._Window.slope_bound = lambda win: math.inf  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        loss._Window.cv_under, loss._Window.slope_bound = self.saved  # type: ignore[method-assign]


def _plateau_values(kind: str, seed: int) -> List[float]:
    """A loss that opens a plateau and is refreshed on it: flat with noise (``flat``), drifting slowly
    (``drift``: the slope near plateau_max_change, the bound fails at times), swinging at times
    (``swing``: the spread near the swing bar), then falling away (``fall``: it clears)."""
    rng = random.Random(seed)
    out = []
    for k in range(420):
        value = 2.0 * (1 + 0.003 * rng.gauss(0, 1))
        if kind == "drift":
            value -= 0.0009 * k * (1 + seed % 3)
        elif kind == "swing" and (k // 60) % 2:
            value *= 1 + 0.08 * rng.choice((-1, 1))
        elif kind == "fall" and k > 300:
            value *= 0.5
        out.append(value)
    return out


KINDS = ("flat", "drift", "swing", "fall")


@PURE
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_open_plateau_streams_are_unchanged(kind: str, seed: int) -> None:
    bounds = _Bounds()
    events = _events_of(_plateau_values(kind, seed), f"{kind}-{seed}")
    run_fast_and_slow(events, SETTINGS, bounds, _off, piece=29 + seed)
    assert not bounds.failed, bounds.failed[:3]
    if kind == "flat":
        assert bounds.decided > 30, bounds.decided


@pytest.mark.parametrize("seed", range(0, 48, 3))
def test_synthetic_streams_are_unchanged(seed: int) -> None:
    bounds = _Bounds()
    run_fast_and_slow(list(_loss_stream(seed)), VARIANTS[seed % len(VARIANTS)], bounds, _off,
                      piece=5 + seed % 7)
    assert not bounds.failed, bounds.failed[:3]


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS if s.source == "cpu"])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    bounds = _Bounds()
    run_fast_and_slow(next(s for s in SCENARIOS if s.name == scenario).events(), SETTINGS, bounds, _off)
    assert not bounds.failed, bounds.failed[:3]
