"""``robust.median``, ``robust.mad`` and ``robust.theil_sen`` compute their medians without
``statistics.median``'s call overhead (issue 15): the results must equal ``statistics.median``'s bit for
bit -- ints and floats, odd and even lengths, ties, -0.0 beside 0.0, huge and tiny magnitudes -- on the
value lists the detectors actually judge (the recorded scenario streams' metric values, windowed)."""

from __future__ import annotations

import math
import statistics
import struct
from typing import Dict, List, Sequence

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import robust
from trainguard_engine.extract import metric_points


def _bits(x: float) -> bytes:
    return struct.pack("<d", float(x))


def _series() -> Dict[str, List[float]]:
    """Every finite metric series of the recorded scenario streams, in arrival order."""
    out: Dict[str, List[float]] = {}
    for scenario in SCENARIOS:
        for env in scenario.events():
            for name, _step, value in metric_points(env):
                if math.isfinite(value):
                    out.setdefault(f"{scenario.name}/{name}", []).append(value)
    return out


def _windows(values: Sequence[float]) -> List[Sequence[float]]:
    return [values[i:i + w] for w in (1, 2, 3, 4, 7, 8, 32) for i in range(0, max(1, len(values) - w + 1), 5)]


def test_median_and_mad_equal_statistics_bit_for_bit() -> None:
    checked = 0
    for values in _series().values():
        for win in _windows(values):
            assert _bits(robust.median(win)) == _bits(statistics.median(win))
            c = statistics.median(win)
            assert _bits(robust.mad(win)) == _bits(statistics.median([abs(v - c) for v in win]))
            checked += 1
    assert checked > 1000
    odd = [0.0, -0.0, 3, 1, 2.5, 2.5, -1e308, 1e-308, 7, 7]
    for n in range(1, len(odd) + 1):
        assert _bits(robust.median(odd[:n])) == _bits(statistics.median(odd[:n]))
        assert _bits(robust.median(odd[:n][::-1])) == _bits(statistics.median(odd[:n][::-1]))
    assert math.isnan(robust.median([])) and math.isnan(robust.mad([]))


def test_theil_sen_equals_the_statistics_definition() -> None:
    for values in list(_series().values())[:40]:
        for win in _windows(values):
            xs = list(range(len(win)))
            slopes = [(win[j] - win[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))]
            slope, intercept = robust.theil_sen(xs, list(win))
            if not slopes:
                assert slope == 0.0
                continue
            want = statistics.median(slopes)
            assert _bits(slope) == _bits(want)
            assert _bits(intercept) == _bits(statistics.median(y - want * x for x, y in zip(xs, win)))
