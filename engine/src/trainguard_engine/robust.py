"""Robust statistics for the detectors: medians and MAD, an EWMA, trend and curvature tests. Pure.

Everything here works on a *bounded* window the caller passes in (the detectors take at most a few dozen
points from a rank's history) and never keeps references to it, so memory stays bounded by the callers'
windows; the one stateful helper, :class:`Ewma`, is two floats. Non-finite values are the caller's
business: pass finite floats (the functions do not filter, and a NaN in a median is undefined).

Why these: loss and gradient scales differ by orders of magnitude between models, and minibatch noise is
heavy-tailed (one bad batch, one spike). Medians and the MAD are unaffected by a few outliers; the
Mann-Kendall test only uses the *order* of values, so it is scale-free and outlier-proof; the Theil-Sen
slope is the median of pairwise slopes (29% breakdown point). Ratios to a median make thresholds such as
"6x its running median" or "swings of 30% of the level" mean the same thing for any model.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

MAD_TO_SIGMA = 1.4826
"""MAD x this = the standard deviation, for normally distributed data."""


def median(values: Sequence[float]) -> float:
    """The median (NaN for an empty sequence): ``statistics.median``'s result bit for bit (the same sort,
    the same middle value or mean of the two middle ones), without its call overhead -- the detectors
    take thousands of medians of a few dozen values per second."""
    return median_sorted(sorted(values))


def median_sorted(ordered: Sequence[float]) -> float:
    """:func:`median` of values already sorted (NaN when empty): the middle one or the mean of the two."""
    n = len(ordered)
    if n == 0:
        return math.nan
    i = n // 2
    return ordered[i] if n % 2 else (ordered[i - 1] + ordered[i]) / 2


def mad(values: Sequence[float], center: Optional[float] = None) -> float:
    """The median absolute deviation from ``center`` (default: the median); raw, not scaled to sigma."""
    if not values:
        return math.nan
    c = median(values) if center is None else center
    return median([abs(v - c) for v in values])


def robust_cv(values: Sequence[float]) -> float:
    """Robust coefficient of variation: ``1.4826 * MAD / |median|`` (the spread relative to the level).
    0 for a constant sequence, +inf when the median is 0 but the values spread."""
    m = median(values)
    spread = MAD_TO_SIGMA * mad(values, m)
    if spread == 0.0:
        return 0.0
    return spread / abs(m) if m != 0.0 else math.inf


def robust_z(value: float, center: float, spread_mad: float) -> float:
    """How many robust standard deviations ``value`` is from ``center`` (inf/0 when the MAD is 0)."""
    scale = MAD_TO_SIGMA * spread_mad
    if scale == 0.0:
        return 0.0 if value == center else math.copysign(math.inf, value - center)
    return (value - center) / scale


def rolling_median(values: Sequence[float], width: int) -> List[float]:
    """Medians of every window of ``width`` consecutive values (``len - width + 1`` of them; ``[]`` when
    there are fewer values than ``width``)."""
    if width <= 0:
        raise ValueError("width must be > 0")
    return [median(values[i:i + width]) for i in range(len(values) - width + 1)]


@dataclass(frozen=True)
class MannKendall:
    """The Mann-Kendall trend test: ``s`` = sum of sign(x_j - x_i) over i < j, ``z`` its normal score
    (continuity-corrected, ties accounted for). z >= 2.33 is a rising trend at one-sided p ~ 0.01, z <=
    -2.33 a falling one; ``tau`` = s / pairs is Kendall's tau against time (-1 .. 1)."""

    n: int
    s: int
    z: float
    tau: float


def bisect_left_of(ordered: List[float], x: float, lo: int = 0) -> int:
    """``bisect.bisect_left(ordered, x, lo)`` of a sorted list of floats (0 <= ``lo``), the same index
    (the same ``<`` comparisons); compiled: native float comparisons, no boxed ``x``, no call into bisect."""
    hi = len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if ordered[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def bisect_right_of(ordered: List[float], x: float, lo: int = 0) -> int:
    """``bisect.bisect_right(ordered, x, lo)`` of a sorted list of floats (0 <= ``lo``): see
    :func:`bisect_left_of`."""
    hi = len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < ordered[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def kendall_s(values: Sequence[float]) -> int:
    """sum of sign(x_j - x_i) over i < j. For finite values: each value against the sorted earlier ones
    (bisect), O(n log n) comparisons instead of n^2 / 2 subtractions -- the same integer, since for
    finite floats x_j - x_i > 0 exactly when x_j > x_i. Anything else: the pairwise definition."""
    total = sum(values)  # finite when every value is (a NaN or an inf makes it non-finite); an overflow
    #                      to inf of finite values only sends them to the exact test
    if total - total != 0.0 and not all(v - v == 0.0 for v in values):  # NaN or +-inf: the subtraction's
        s = 0
        for i in range(len(values) - 1):
            vi = values[i]
            for j in range(i + 1, len(values)):
                d = values[j] - vi
                if d > 0:
                    s += 1
                elif d < 0:
                    s -= 1
        return s
    earlier: List[float] = []
    s = 0
    for count, v in enumerate(values):
        below = bisect_left_of(earlier, v)
        s += below - (count - bisect_right_of(earlier, v, below))
        earlier.insert(below, v)
    return s


def mann_kendall(values: Sequence[float]) -> MannKendall:
    """Mann-Kendall trend test of ``values`` in time order. O(n log n) for finite values, else O(n^2):
    callers pass bounded windows."""
    n = len(values)
    if n < 3:
        return MannKendall(n, 0, 0.0, 0.0)
    return mann_kendall_of(n, kendall_s(values), kendall_ties(values))


def kendall_tie_term(t: int) -> int:
    """One group of ``t`` equal values' share of :func:`kendall_ties`: t (t - 1) (2 t + 5)."""
    return t * (t - 1) * (2 * t + 5)


def kendall_ties(values: Sequence[float]) -> int:
    """The tie correction of :func:`mann_kendall`'s variance: the sum of :func:`kendall_tie_term` over the
    groups of t equal values (the same equality as a dict's keys: 0.0 and -0.0 tie)."""
    if len(set(values)) == len(values):
        return 0
    return sum(kendall_tie_term(t) for t in Counter(values).values() if t > 1)


def mann_kendall_of(n: int, s: int, ties: int) -> MannKendall:
    """:func:`mann_kendall`'s result for ``n`` values whose S is ``s`` and tie correction ``ties``
    (:func:`kendall_ties`) -- :func:`mann_kendall` itself, and a caller that keeps S and the ties of a
    sliding window: one arithmetic, so the same floats."""
    if n < 3:
        return MannKendall(n, 0, 0.0, 0.0)
    var = (n * (n - 1) * (2 * n + 5) - ties) / 18.0
    if var <= 0:
        return MannKendall(n, s, 0.0, 0.0)
    if s > 0:
        z = (s - 1) / math.sqrt(var)
    elif s < 0:
        z = (s + 1) / math.sqrt(var)
    else:
        z = 0.0
    return MannKendall(n, s, z, s / (n * (n - 1) / 2))


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """``(slope, intercept)`` of the Theil-Sen line: the median of the pairwise slopes (pairs with equal
    x skipped) and the median of ``y - slope * x``. ``(0, median(y))`` when no pair has distinct x.
    O(n^2): callers pass bounded windows."""
    if len(xs) != len(ys):
        raise ValueError("xs and ys differ in length")
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs) - 1) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    if not slopes:
        return 0.0, median(ys) if ys else math.nan
    slope = median(slopes)
    return slope, median([y - slope * x for x, y in zip(xs, ys)])


@dataclass(frozen=True)
class Curvature:
    """Second derivative of a least-squares quadratic through the points (``d2`` = 2a for
    y = a x^2 + b x + c, in y-units per x-unit squared), its standard error ``se`` and the fitted level
    at the window's centre."""

    d2: float
    se: float
    level: float


def curvature(xs: Sequence[float], ys: Sequence[float]) -> Optional[Curvature]:
    """Quadratic least-squares fit of ``ys`` against ``xs`` (x centred for conditioning); None with fewer
    than 4 points or degenerate x. The standard error uses the residual variance RSS / (n - 3)."""
    n = len(xs)
    if n < 4 or len(ys) != n:
        return None
    mx = sum(xs) / n
    u = [x - mx for x in xs]
    # normal equations for y = c0 + c1 u + c2 u^2
    s1 = sum(u)
    s2 = sum(v * v for v in u)
    s3 = sum(v ** 3 for v in u)
    s4 = sum(v ** 4 for v in u)
    t0 = sum(ys)
    t1 = sum(v * y for v, y in zip(u, ys))
    t2 = sum(v * v * y for v, y in zip(u, ys))
    m = [[float(n), s1, s2], [s1, s2, s3], [s2, s3, s4]]
    inv = _inverse3(m)
    if inv is None:
        return None
    c = [sum(inv[i][k] * t for k, t in enumerate((t0, t1, t2))) for i in range(3)]
    rss = sum((y - (c[0] + c[1] * v + c[2] * v * v)) ** 2 for v, y in zip(u, ys))
    sigma2 = rss / (n - 3) if n > 3 else 0.0
    se = 2.0 * math.sqrt(max(0.0, sigma2 * inv[2][2]))
    return Curvature(d2=2.0 * c[2], se=se, level=c[0])


def _inverse3(m: List[List[float]]) -> Optional[List[List[float]]]:
    a, b, c = m[0]
    d, e, f = m[1]
    g, h, i = m[2]
    det = a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
    scale = max(abs(x) for row in m for x in row) ** 3
    if scale == 0.0 or abs(det) <= 1e-12 * scale:
        return None
    return [[(e * i - f * h) / det, (c * h - b * i) / det, (b * f - c * e) / det],
            [(f * g - d * i) / det, (a * i - c * g) / det, (c * d - a * f) / det],
            [(d * h - e * g) / det, (b * g - a * h) / det, (a * e - b * d) / det]]


@dataclass
class Ewma:
    """Exponentially weighted moving average: ``value <- (1 - alpha) value + alpha x``; the first value
    initialises it. Two floats of state; ``to_json``/``from_json`` for snapshots."""

    alpha: float
    value: float = 0.0
    n: int = 0

    def update(self, x: float) -> float:
        """Fold in ``x`` (finite); returns the new average."""
        self.value = x if self.n == 0 else (1.0 - self.alpha) * self.value + self.alpha * x
        self.n += 1
        return self.value

    def to_json(self) -> Dict[str, Any]:
        return {"alpha": self.alpha, "value": self.value, "n": self.n}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> Ewma:
        return cls(alpha=float(data["alpha"]), value=float(data["value"]), n=int(data["n"]))


def trailing_run(flags: Sequence[bool]) -> int:
    """How many of the last values are True in a row."""
    run = 0
    for flag in reversed(flags):
        if not flag:
            break
        run += 1
    return run
