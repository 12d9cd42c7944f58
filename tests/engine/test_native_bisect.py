"""The engine's own bisections and least value (issue 15, stop 50): ``robust.bisect_left_of`` /
``bisect_right_of`` stand in for ``bisect.bisect_left`` / ``bisect_right`` / ``insort_right`` on the sorted
float windows the detectors keep (the loss curve's sorted windows, the straggler's columns, the memory
detector's Mann-Kendall column, ``robust.kendall_s``), ``numeric.least`` for ``min`` of a loss part's
initial values. Compiled they compare natively; they must answer the same index, and the same value, as
the builtins -- for the value lists the detectors actually keep (the recorded scenario streams' finite
metric values, windowed and sorted), with ties, -0.0 beside 0.0, and every ``lo``."""

from __future__ import annotations

import bisect
import math
import struct
from typing import List

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import robust
from trainguard_engine.detectors import numeric
from trainguard_engine.extract import metric_points


def _windows() -> List[List[float]]:
    """Sorted windows of up to 24 consecutive finite values of every recorded scenario series, plus
    hand-made ones with ties and signed zeros."""
    series: dict = {}
    for scenario in SCENARIOS:
        for env in scenario.events():
            for name, _step, value in metric_points(env):
                if math.isfinite(value):
                    series.setdefault(f"{scenario.name}/{name}", []).append(value)
    out = [sorted(values[i:i + 24]) for values in series.values() for i in range(0, len(values), 17)]
    out += [[], [0.0], [-0.0, 0.0, 0.0, -0.0], [1.0, 1.0, 1.0], [-1e308, -5e-324, 0.0, 5e-324, 1e308]]
    return [sorted(w) for w in out]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_the_bisections_answer_the_builtins_index_for_every_probe_and_lo() -> None:
    windows = _windows()
    assert len(windows) > 100
    checked = 0
    for ordered in windows:
        probes = set(ordered) | {-0.0, 0.0, -math.inf, math.inf}
        probes |= {v * (1 + 1e-12) for v in ordered} | {v - 1e-9 for v in ordered}
        for x in probes:
            for lo in range(len(ordered) + 1):
                assert robust.bisect_left_of(ordered, x, lo) == bisect.bisect_left(ordered, x, lo)
                assert robust.bisect_right_of(ordered, x, lo) == bisect.bisect_right(ordered, x, lo)
                checked += 1
    assert checked > 10_000


def test_an_insertion_at_bisect_right_of_is_insort_right_bit_for_bit() -> None:
    """The sorted window slid by insertions keeps the same floats in the same order as insort_right's,
    -0.0 and 0.0 included (equal under <: the newest goes after its equals)."""
    values = [0.5, -0.0, 0.0, 0.5, -0.0, 2.0, 0.0, 0.5]
    ours: List[float] = []
    theirs: List[float] = []
    for v in values:
        ours.insert(robust.bisect_right_of(ours, v), v)
        bisect.insort_right(theirs, v)
        assert [_bits(a) for a in ours] == [_bits(b) for b in theirs]


def test_least_is_min_bit_for_bit() -> None:
    for ordered in _windows():
        for values in (ordered, ordered[::-1], ordered[1:] + ordered[:1]):
            if values:
                assert _bits(numeric.least(values)) == _bits(min(values))
    assert _bits(numeric.least([0.0, -0.0])) == _bits(min([0.0, -0.0]))  # the first of the least
    assert _bits(numeric.least([-0.0, 0.0])) == _bits(min([-0.0, 0.0]))
