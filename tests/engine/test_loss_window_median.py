"""The loss-curve detector's window statistics are read without building lists first (issue 15):
``loss._median_of`` sorts the points' values straight from the series and ``loss._Window`` builds its step
and value lists only when a rule asks for them. After every loss point of recorded streams -- in order,
with late points, replayed envelopes, non-finite values, trims and ranks restored from their snapshot
mid-stream -- the median must equal ``statistics.median`` of the window's values bit for bit (ties and
-0.0 beside 0.0 included), and the window's lists and end steps an eager recount. The same for the windows
kept sorted point by point beside the series' tail (``loss._sorted_window``: the sorted list itself, bit for
bit, and the spread and the plateau rule's block slope taken from it)."""

from __future__ import annotations

import random
import statistics
from typing import Dict, Iterator, List, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine import robust
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.detectors.numeric import recent
from trainguard_engine.extract import metric_points, recent_points
from trainguard_engine.state import RankState, SeriesTail

SETTINGS = DetectionSettings()
SMALL = DetectionSettings.from_overrides({"history_len": 48})  # trims every 48 points: often
STREAMS = ("oscillation", "rise_after_fall", "plateau", "explosion", "nan_source", "healthy_lm")
SIZES = (SETTINGS.loss_window, SETTINGS.rise_smooth, 4, loss.SORTED_WINDOW_MIN)


def _hex(values: List[float]) -> List[str]:
    return [float(v).hex() for v in values]


@pytest.mark.parametrize("stream", STREAMS)
def test_window_statistics_equal_a_recount(stream: str) -> None:
    events = [e for e in next(s for s in SCENARIOS if s.name == stream).events() if metric_points(e)]
    assert len(events) > 50
    order = list(events)
    for i in range(0, len(order) - 4, 11):  # every 11th envelope swapped with the 4th after it: late points
        order[i], order[i + 4] = order[i + 4], order[i]
    delivered = [e for i, e in enumerate(order) for _ in range(2 if i % 7 == 3 else 1)]  # replays
    ranks: Dict[int, RankState] = {}
    checked = 0
    for n, env in enumerate(delivered):
        r = int(env.get("rank", 0))
        rank = ranks.setdefault(r, RankState(r))
        points = metric_points(env)
        for name, step, value in points:
            rank.observe_point(name, step, value, int(env.get("time_unix_nano", 0)), SMALL)
        for name, step, value in recent_points(env):
            rank.observe_point(name, step, value, 0, SMALL, context=True)
        for name, step, _value in points:
            if not SETTINGS.is_loss(name):
                continue
            series = recent(rank, name, SETTINGS.loss_window, step)
            source = loss._exact_tail(rank, name, series)
            if source is not None:
                assert series == source.points[len(source.points) - len(series):]
            for size in SIZES:
                tail = series[-size:]
                values = [v for _s, v, _t in tail]
                kept = loss._Window(series, size, source)
                assert _hex(kept.ordered) == _hex(sorted(values)), (stream, n, size)
                assert kept.median.hex() == statistics.median(values).hex(), (stream, n, size)
                assert kept.cv.hex() == robust.robust_cv(values).hex(), (stream, n, size)
                assert loss._median_last(series, size, source).hex() == statistics.median(values).hex()
                if kept.full and (n + size) % 3:  # (asked for on most points: a kept S slides, else recounts)
                    assert _trend(kept.trend) == _trend(robust.mann_kendall(values)), (stream, n, size)
                win = loss._Window(series, size)
                assert win.median.hex() == statistics.median(values).hex(), (stream, n, size)
                assert loss._median_of(tail).hex() == statistics.median(values).hex(), (stream, n, size)
                assert (win.steps, win.values) == ([s for s, _v, _t in tail], values)
                assert (win.first_step, win.last_step) == (tail[0][0], tail[-1][0])
                assert win.full == (len(series) >= size)
                checked += 1
        if n % 97 == 0:  # a restored rank: a new object from its snapshot
            ranks = {k: RankState.from_json(s.to_json()) for k, s in ranks.items()}
    assert checked > 100


def test_ties_and_signed_zeros_give_statistics_median() -> None:
    """Equal values, -0.0 beside 0.0, odd and even counts: the same float as ``statistics.median``."""
    stream = [0.0, -0.0, 1.0, 0.0, -0.0, 1.0, 1.0, -0.0, 0.0, 2.0, -0.0, 0.0, 0.0, -0.0, 3.5, 1e308, 1e308]
    points = [(i, v, 0) for i, v in enumerate(stream)]
    for lo in range(len(points)):
        for hi in range(lo + 1, len(points) + 1):
            want = statistics.median([v for _s, v, _t in points[lo:hi]])
            assert loss._median_of(points[lo:hi]).hex() == want.hex(), (lo, hi)
    assert loss._median_of([]) != loss._median_of([])  # NaN when empty, as robust.median


def _finite_windows(rng: random.Random, width: int, steps: int,
                    pooled: float) -> Iterator[Tuple[int, SeriesTail]]:
    """A series' tail, point by point, wherever its last ``width`` values are all finite: a value from a
    pool of ties, -0.0 beside 0.0 and extremes (``pooled`` of the time) or uniform in [-3, 3], a NaN at
    step 300 passing through, a trim at step 450 (a new tail over the kept points, its windows empty).
    Lazy, drawing from ``rng``: the caller's own draws between two points stay in their place."""
    pool = [0.0, -0.0, 1.0, 2.5, -1.0, 1e-300, 1e308]
    data: Dict[int, tuple] = {}
    tail = SeriesTail(data)
    for step in range(steps):
        value = rng.choice(pool) if rng.random() < pooled else rng.uniform(-3, 3)
        if step == 300:
            value = float("nan")
        data[step] = (value, step)
        tail.append(step, value, step)
        if step == 450:
            tail = tail.trimmed(data, 0)
        start = len(tail.points) - width
        if start >= 0 and start >= tail.bad_end:
            yield step, tail


def test_sorted_window_keeps_sorted_order_bit_for_bit() -> None:
    """Point by point, with ties, -0.0 beside 0.0, a non-finite value passing through and a trim: the kept
    window is ``sorted()``'s list of the last ``width`` values -- the same floats in the same order."""
    rng = random.Random(15)
    for width in (16, 40):
        checked = 0
        for step, tail in _finite_windows(rng, width, 600, pooled=0.7):
            if rng.random() < 0.1:  # (skipped: the next one re-sorts)
                continue
            want = sorted(v for _s, v, _t in tail.points[-width:])
            assert _hex(loss._sorted_window(tail, width)) == _hex(want), (width, step)
            checked += 1
        assert checked > 400


def _trend(mk: robust.MannKendall) -> tuple:
    return mk.n, mk.s, mk.z.hex(), mk.tau.hex()


def _pairwise(values: List[float]) -> robust.MannKendall:
    """Mann-Kendall by its definition: S over every pair, the ties from a Counter."""
    n = len(values)
    s = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
    groups: Dict[float, int] = {}
    for v in values:
        groups[v] = groups.get(v, 0) + 1
    return robust.mann_kendall_of(n, s, sum(t * (t - 1) * (2 * t + 5) for t in groups.values()))


def test_kept_trend_slides_bit_for_bit() -> None:
    """The Mann-Kendall test of a window kept beside the series' tail (``loss._kept_trend``: S and the tie
    correction slid point by point) equals ``robust.mann_kendall`` of the window's values and the
    definition's -- the same n, S, z and tau, bit for bit -- with ties, -0.0 beside 0.0, a non-finite value
    passing through, a trim, points where nobody asks (the kept S then goes stale and is recounted) and a
    stretch where the sorted window moves on unasked for longer than a window (the kept S is let go)."""
    rng = random.Random(38)
    for width in (16, 40):
        checked = 0
        for step, tail in _finite_windows(rng, width, 700, pooled=0.6):
            if step == 580:
                assert width not in loss._derived(tail).kendall  # let go after a window's worth unasked
            if rng.random() < 0.3 or 520 <= step < 580:  # the sorted window moves on, the trend is not
                loss._sorted_window(tail, width)        # asked for (520-579: long enough to be let go)
                continue
            if rng.random() < 0.05:  # nothing asked: the next point re-sorts and recounts
                continue
            values = [v for _s, v, _t in tail.points[-width:]]
            got = _trend(loss._kept_trend(tail, width))
            assert got == _trend(robust.mann_kendall(values)) == _trend(_pairwise(values)), (width, step)
            checked += 1
        assert checked > 250


def test_block_slope_is_theil_sens() -> None:
    """The plateau rule's slope through 4-value block medians equals ``robust.theil_sen``'s over
    ``_median4`` of the blocks, for windows of any length (a trailing part block left out)."""
    rng = random.Random(16)
    for length in (0, 3, 4, 7, 8, 9, 40, 41, 43):
        steps = sorted(rng.sample(range(10_000), length))
        values = [rng.choice((0.0, -0.0, 1.0, rng.uniform(0, 5))) for _ in range(length)]
        blocks = [(loss._median4(steps[i:i + 4]), loss._median4(values[i:i + 4]))
                  for i in range(0, length - 3, 4)]
        want, _ = robust.theil_sen([b[0] for b in blocks], [b[1] for b in blocks])
        assert loss._block_slope(steps, values).hex() == float(want).hex(), length
