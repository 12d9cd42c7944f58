"""The leak rule's sliding Mann-Kendall test (issue 15, stop 44, speed only): ``memory._SlidingTrend`` keeps S and
the tie correction of a leak series' fine window as it slides, and ``leak_test`` answers "no rising trend" from it
without reading the window. It must change nothing:

- its S and ties equal robust.kendall_s / kendall_ties of the window's values after any sequence of appends,
  drops of the oldest and replacements of the newest (ties, 0.0 / -0.0, repeated values);
- ``leak_test`` with it answers what it answers without it, on random windows that do and do not leak;
- a pipeline that keeps it gives, piece by piece, the outputs and snapshots (restored every third piece: the
  kept trend is derived and starts afresh) of one that never keeps it (the reference: leak_test without a
  trend), on every corpus scenario and on synthetic memory streams -- device and host series, mem/* metrics
  only, leaks, flat and noisy memory, same-step repeats, replays, two devices, windows shorter than the
  default -- and the fast path is taken (the window's Mann-Kendall is computed far less often).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, Iterator, List
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import memory
from trainguard_engine.robust import kendall_s, kendall_ties, mann_kendall

PURE = pytest.mark.engine_pure("counts memory.mann_kendall / leak_test calls")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
SHORT = DetectionSettings.from_overrides({"leak_window": 14, "leak_min_samples": 6, "leak_skip_samples": 1})
GIB = 2.0 ** 30


def _check(trend: memory._SlidingTrend) -> None:
    assert trend.s == kendall_s(trend.values)
    assert trend.ties == kendall_ties(trend.values)
    assert trend.ordered == sorted(trend.values)
    assert trend.test() == mann_kendall(trend.values)


@pytest.mark.parametrize("seed", range(8))
def test_the_sliding_s_and_ties_are_the_whole_windows(seed: int) -> None:
    rng = random.Random(seed)
    pool = [0.0, -0.0, 1.0, 2.0, 2.5, 3.0, 1e9, -4.0]
    trend = memory._SlidingTrend([])
    for _ in range(400):
        r = rng.random()
        value = rng.choice(pool) if rng.random() < 0.6 else rng.uniform(-5, 5)
        if r < 0.55 or not trend.values:
            trend.append(value)
        elif r < 0.8:
            trend.drop_first()
        else:
            trend.drop_last()
            trend.append(value)
        _check(trend)
    built = memory._SlidingTrend([[i, 0, v, 0.0] for i, v in enumerate(trend.values)])
    assert (built.s, built.ties, built.values) == (trend.s, trend.ties, trend.values)


def test_leak_test_answers_the_same_with_the_kept_trend() -> None:
    rng = random.Random(6)
    answered = {True: 0, False: 0}
    near = [0]
    for _ in range(3000):
        n = rng.randrange(8, 60)
        slope = rng.choice([0.0, 0.0, 1e6, 5e6, -1e6])
        noise = rng.choice([0.0, 1e5, 3e6])
        level = rng.choice([0.0, 2 * GIB])
        points = [[10 * i + (rng.random() < 0.05) * 10, i, level + slope * i + rng.gauss(0, noise) * (noise > 0),
                   level + 1.5 * slope * i] for i in range(n)]
        if rng.random() < 0.5:  # a leak under upward spikes: trends near the bar (z 3-4) among them
            spike, share = rng.choice([1e8, 3e8, 6e8]), rng.choice([0.2, 0.4, 0.6])
            points = [[10 * i, i, 2 * GIB + 1e7 * i +
                       (spike * rng.random() if rng.random() < share else 0.0), 0.0] for i in range(n)]
        for use_peak in (False, True):
            for settings in (SETTINGS, SHORT):
                plain = memory.leak_test(points, settings, use_peak)
                kept = memory.leak_test(points, settings, use_peak, mann_kendall([float(p[2]) for p in points]))
                assert kept == plain
                answered[plain is not None] += 1
                if plain is not None and plain["z"] < 4.0:
                    near[0] += 1
    assert answered[True] > 20 and answered[False] > 200
    assert near[0] > 0  # leaks whose trend is near the bar (z < 4): where a wrong shortcut would show


@contextlib.contextmanager
def _never_kept() -> Iterator[None]:
    """The reference: no trend kept, leak_test computes the window's test itself (as before)."""
    with patch.object(memory, "_kept_trend", lambda rank, device, fine: None), \
            patch.object(memory, "_new_trend", lambda rank, device, fine: None):
        yield


def _memory_stream(seed: int) -> List[Dict[str, Any]]:
    """Two ranks of one run: CUDA memory events (two devices on rank 1), some ranks' host RSS, mem/* metrics
    of a third rank; growth that leaks, flat, noisy or cache-filled-once; same-step repeats and replays."""
    rng = random.Random(seed)
    out: List[Dict[str, Any]] = []
    base = 1_800_000_000_000_000_000
    shapes = {r: rng.choice(["leak", "flat", "noisy", "once", "slow"]) for r in range(4)}

    def level(r: int, step: int) -> float:
        shape = shapes[r]
        if shape == "leak":
            return 2 * GIB + 8e6 * step
        if shape == "flat":
            return 3 * GIB
        if shape == "noisy":
            return 3 * GIB + rng.choice([0.0, 1e6, 2e6, -1e6])
        if shape == "once":
            return 3 * GIB + (5e8 if step > 100 else 0.0)
        return 3 * GIB + 1e6 * step + rng.gauss(0, 4e6)

    for step in range(0, 400, 2):
        for r in range(4):
            t = base + step * 10 ** 9 + r
            value = level(r, step)
            if r == 3:  # mem/* metrics only
                points = [{"name": "mem/allocated", "value": value}, {"name": "mem/reserved", "value": value * 1.2}]
                out.append({"project": "p", "run_id": f"m{seed}", "rank": 3, "step": step, "time_unix_nano": t,
                            "event_id": f"x{step}", "metrics": {"points": points}})
                continue
            body: Dict[str, Any] = ({"rss": value} if r == 2 else
                                    {"device": "cuda:0", "allocated": value, "max_allocated": value * 1.1,
                                     "reserved": value * 1.3, "total_capacity": 80 * GIB})
            event = {"project": "p", "run_id": f"m{seed}", "rank": r, "step": step, "time_unix_nano": t,
                     "event_id": f"e{r}-{step}", "memory": body}
            out.append(event)
            if r == 1:
                out.append(dict(event, event_id=f"f{step}", time_unix_nano=t + 5,
                                memory=dict(body, device="cuda:1", allocated=value / 2 + rng.choice([0.0, 1e6]))))
            roll = rng.random()
            if roll < 0.05:  # the same step again, later: the later sample stands
                out.append(dict(event, event_id=f"r{r}-{step}", time_unix_nano=t + 7,
                                memory=dict(body, **{("rss" if r == 2 else "allocated"): value + 3e6})))
            elif roll < 0.08 and len(out) > 30:  # a replay of an earlier event
                out.append(rng.choice(out[-30:]))
    return out


def _counting() -> Any:
    """Counts the window tests memory runs itself; with ``checked`` also asserts that every kept trend handed
    to leak_test is the whole window's test (the oracle, at every sample)."""
    calls = [0]
    saved, saved_leak_test = memory.mann_kendall, memory.leak_test

    def counted(values: Any) -> Any:
        calls[0] += 1
        return saved(values)

    def checked(points: Any, settings: Any, use_peak: bool, trend: Any = None) -> Any:
        if trend is not None:
            assert trend == mann_kendall([float(p[2]) for p in points])
        return saved_leak_test(points, settings, use_peak, trend)

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with patch.object(memory, "mann_kendall", counted), patch.object(memory, "leak_test", checked):
            yield

    return calls, both


class _Each:
    """A context made afresh by ``make`` at each entry (run_fast_and_slow enters ``fast`` once per piece)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._now: Any = None

    def __enter__(self) -> None:
        self._now = self._make()
        self._now.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._now.__exit__(*exc)


@PURE
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("settings", [SETTINGS, SHORT], ids=["defaults", "short-window"])
def test_kept_trend_gives_what_the_whole_window_gives(seed: int, settings: DetectionSettings) -> None:
    events = _memory_stream(seed)
    fast_calls, fast = _counting()
    run_fast_and_slow(events, settings, _Each(fast), _never_kept, piece=53)
    slow_calls, counting = _counting()
    with counting(), _never_kept():
        run_fast_and_slow(events, settings, contextlib.nullcontext(), contextlib.nullcontext, piece=53)
    # the fast path is taken: fewer tests of whole windows (the second run counts both of its pipelines;
    # 0.41-0.91 of them on these streams: a leaking window is still tested whole, from its rising trend on)
    assert fast_calls[0] < 0.95 * slow_calls[0] / 2


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_kept_trend_on_the_corpus(scenario: Any) -> None:
    run_fast_and_slow(scenario.events(), SETTINGS, contextlib.nullcontext(), _never_kept)
