"""The loss-curve detector's window statistics are read without building lists first (issue 15):
``loss._median_of`` sorts the points' values straight from the series and ``loss._Window`` builds its step
and value lists only when a rule asks for them. After every loss point of recorded streams -- in order,
with late points, replayed envelopes, non-finite values, trims and ranks restored from their snapshot
mid-stream -- the median must equal ``statistics.median`` of the window's values bit for bit (ties and
-0.0 beside 0.0 included), and the window's lists and end steps an eager recount."""

from __future__ import annotations

import statistics
from typing import Dict

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.detectors.numeric import recent
from trainguard_engine.extract import metric_points, recent_points
from trainguard_engine.state import RankState

SETTINGS = DetectionSettings()
SMALL = DetectionSettings.from_overrides({"history_len": 48})  # trims every 48 points: often
STREAMS = ("oscillation", "rise_after_fall", "plateau", "explosion", "nan_source", "healthy_lm")
SIZES = (SETTINGS.loss_window, SETTINGS.rise_smooth, 4)


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
            for size in SIZES:
                tail = series[-size:]
                values = [v for _s, v, _t in tail]
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
