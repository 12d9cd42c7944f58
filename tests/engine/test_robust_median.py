"""``robust.median``, ``robust.mad`` and ``robust.theil_sen`` compute their medians without
``statistics.median``'s call overhead, ``robust.mann_kendall`` skips its exact checks when a sum and a set
say they cannot matter (issue 15): the medians must equal ``statistics.median``'s bit for
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


def _reference_mann_kendall(values: Sequence[float]) -> robust.MannKendall:
    """The textbook definition: every pair subtracted, ties counted with a dict."""
    n = len(values)
    if n < 3:
        return robust.MannKendall(n, 0, 0.0, 0.0)
    s = sum((d > 0) - (d < 0) for i in range(n) for d in (values[j] - values[i] for j in range(i + 1, n)))
    counts: Dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in counts.values() if t > 1)) / 18.0
    if var <= 0:
        return robust.MannKendall(n, s, 0.0, 0.0)
    z = (s - 1) / math.sqrt(var) if s > 0 else (s + 1) / math.sqrt(var) if s < 0 else 0.0
    return robust.MannKendall(n, s, z, s / (n * (n - 1) / 2))


def test_mann_kendall_equals_the_pairwise_definition() -> None:
    """Its fast paths (finiteness from one sum, ties only when a set is smaller than the values) give the
    pairwise definition's s, z and tau exactly -- on the streams' windows, rounded (ties), and with NaN,
    +-inf, -0.0 and finite values whose sum overflows."""
    checked = 0
    for values in list(_series().values())[:60]:
        for win in _windows(values):
            for case in (list(win), [round(v, 1) for v in win]):
                assert robust.mann_kendall(case) == _reference_mann_kendall(case)
                checked += 1
    assert checked > 500
    odd = [1.0, math.nan, 2.0, math.inf, -math.inf, 0.0, -0.0, 1e308, 1e308, 3.0, 3.0, 1.0]
    for k in range(len(odd)):
        case = odd[k:] + odd[:k]
        got, want = robust.mann_kendall(case), _reference_mann_kendall(case)
        assert (got.n, got.s) == (want.n, want.s)
        assert got.z == want.z or (math.isnan(got.z) and math.isnan(want.z))
    big = [1e308, 1e308, 5.0, 1e308, 2.0]  # sum overflows: the exact test, still all finite
    assert robust.mann_kendall(big) == _reference_mann_kendall(big)
