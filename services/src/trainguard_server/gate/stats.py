"""Robust statistics for tiny samples (2-5 baseline runs), in plain Python (no I/O, no numpy).

Contract: every function is pure and total on finite inputs; ``+inf`` is a legal value where a function
says so (a non-finite loss is treated as infinitely bad, never dropped). Nothing here returns a scale of
exactly 0 unless every input is identical -- callers add their own floors (see ``gate.policy``).

Constants:

- :data:`PAIR_DIFF_TO_SIGMA` turns the median of pairwise absolute differences |x_r - x_q| into a
  standard deviation. The difference of two independent N(mu, s^2) values is N(0, 2 s^2), whose absolute
  value has median 0.67449 * sqrt(2) * s, whatever the number of runs -- which is why the gate pools
  *pairwise* differences (a Shamos-type estimator) instead of deviations from the median, whose
  consistency factor depends on n and on its parity (2.10 for n=2, 1.45 for n=3 after dropping the
  median's own zero, 2.06 for n=4).
- :func:`prediction_inflation` is sd(X_new - median(X_1..X_n)) / s for Gaussian X: how much wider than s a
  band around the *estimated* centre must be for a new run. Exact small-n values from 10^6-draw Monte
  Carlo (tests/services/gate/test_stats.py re-derives them); sqrt(1 + pi / (2n)) beyond n = 10.
- :data:`RUNNING_MEDIAN_EFFICIENCY`: the running median of w i.i.d. N(0, s^2) values has a standard
  deviation of about 1.2533 s / sqrt(w) (the median's asymptotic efficiency, sqrt(pi / 2)).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

MAD_TO_SIGMA = 1.4826
PAIR_DIFF_TO_SIGMA = 1.0 / (math.sqrt(2.0) * 0.6744897501960817)  # = 1.0483
RUNNING_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2.0)  # = 1.2533
_INFLATION = {1: math.sqrt(2.0), 2: 1.2240, 3: 1.2028, 4: 1.1390, 5: 1.1354, 6: 1.1020, 7: 1.1003,
              8: 1.0816, 9: 1.0800, 10: 1.0668}


def median(values: Sequence[float]) -> float:
    """The median (mean of the middle two for an even count); NaN for no values. ``inf`` sorts last; an
    even count whose upper middle value is ``+inf`` has median ``+inf``."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    if n % 2:
        return ordered[mid]
    lo, hi = ordered[mid - 1], ordered[mid]
    if math.isinf(lo) or math.isinf(hi):  # +inf wins (a non-finite loss is never averaged away)
        return math.inf if hi == math.inf else lo
    return (lo + hi) / 2.0


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of the finite values, linearly interpolated between order statistics (as
    numpy's default); NaN for none."""
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return math.nan
    pos = min(max(q, 0.0), 1.0) * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


def mad_sigma(values: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation from the median (consistent for large Gaussian samples)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan
    m = median(finite)
    return MAD_TO_SIGMA * median([abs(v - m) for v in finite])


def pair_sigma(values: Sequence[float]) -> float:
    """Standard deviation from the median pairwise absolute difference (Shamos): 0 for fewer than two
    values. Consistent for Gaussian samples of any size, robust to one outlier among >= 4 values."""
    finite = [v for v in values if math.isfinite(v)]
    diffs = [abs(a - b) for i, a in enumerate(finite) for b in finite[i + 1:]]
    return PAIR_DIFF_TO_SIGMA * median(diffs) if diffs else 0.0


def prediction_inflation(n: int) -> float:
    """sd(new run - median of n runs) / sd(one run), for n >= 1 Gaussian runs (see the module doc)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    return _INFLATION.get(n, math.sqrt(1.0 + math.pi / (2.0 * n)))


def running_median(values: Sequence[float], half_width: int) -> List[float]:
    """Centred running median over ``2 * half_width + 1`` points, the window clipped at the ends (so the
    first and last points use ``half_width + 1`` or more values). ``inf`` values take part like any other
    (a window mostly of ``inf`` stays ``inf``); NaN must be mapped by the caller first."""
    n = len(values)
    if half_width <= 0 or n <= 1:
        return list(values)
    return [median(values[max(0, i - half_width):i + half_width + 1]) for i in range(n)]


def running_mad_sigma(values: Sequence[float], half_width: int) -> List[float]:
    """Centred running 1.4826 x MAD over ``2 * half_width + 1`` points (clipped at the ends); non-finite
    values are ignored; NaN where a window has no finite value."""
    n = len(values)
    return [mad_sigma(values[max(0, i - half_width):i + half_width + 1]) for i in range(n)]


def pooled_pair_sigma(columns: Sequence[Sequence[float]], half_width: int) -> List[float]:
    """Between-run scale at each point of a grid: ``columns[i]`` holds the runs' values at grid point i;
    the pairwise differences of the points within ``half_width`` of i are pooled and their median turned
    into a standard deviation (:data:`PAIR_DIFF_TO_SIGMA`). Pooling over neighbouring points is what
    keeps the estimate usable with 2 runs (one difference per point)."""
    diffs: List[List[float]] = []
    for column in columns:
        finite = [v for v in column if math.isfinite(v)]
        diffs.append([abs(a - b) for k, a in enumerate(finite) for b in finite[k + 1:]])
    out = []
    for i in range(len(columns)):
        pool = [d for window in diffs[max(0, i - half_width):i + half_width + 1] for d in window]
        out.append(PAIR_DIFF_TO_SIGMA * median(pool) if pool else 0.0)
    return out


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation of the points (xs ascending) at ``x``; NaN outside [xs[0], xs[-1]]. Where
    either neighbour is ``inf`` the result is that neighbour (a non-finite value is never averaged away)."""
    n = len(xs)
    if n == 0 or x < xs[0] or x > xs[-1]:
        return math.nan
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    if xs[lo] == x or lo == hi:
        return ys[lo]
    if xs[hi] == x:
        return ys[hi]
    a, b = ys[lo], ys[hi]
    if math.isinf(a) or math.isinf(b):
        return a if math.isinf(a) else b
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return a + t * (b - a)


def longest_run(flags: Sequence[bool]) -> Tuple[int, int]:
    """(start index, length) of the longest stretch of True values; (-1, 0) when there is none."""
    best_start, best_len, start = -1, 0, -1
    for i, flag in enumerate(flags):
        if flag:
            if start < 0:
                start = i
            if i - start + 1 > best_len:
                best_start, best_len = start, i - start + 1
        else:
            start = -1
    return best_start, best_len


def finite_or(value: Optional[float], default: float) -> float:
    """``value`` when it is a finite float, else ``default``."""
    return value if value is not None and math.isfinite(value) else default
