"""``numeric.recent`` (the detectors' "last N points of a series") answers from the series' tail kept beside
the history (``RankState.tails``, issue 15): it must equal a read of the history dict itself after every
kind of update -- points in order, late points, a replayed envelope overwriting its points, an alert's
context points, non-finite values, trims -- on the recorded corpus's metric streams."""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors.numeric import recent
from trainguard_engine.extract import metric_points, recent_points
from trainguard_engine.state import RankState

SMALL = DetectionSettings.from_overrides({"history_len": 16})  # trims every 16 points: often
STREAMS = ("explosion", "nan_source", "oscillation", "healthy_lm")


def _reference(rank: RankState, name: str, most: int, upto: Optional[int]) -> List[Tuple[int, float, int]]:
    """The definition: the history dict's last ``most`` entries in arrival order, finite, <= upto, by step."""
    data = rank.history.get(name)
    if not data or most < 1:
        return []
    out = [(s, v, t) for s, (v, t) in itertools.islice(reversed(data.items()), most)
           if v - v == 0.0 and (upto is None or s <= upto)]
    out.sort()
    return out


@pytest.mark.parametrize("stream", STREAMS)
def test_recent_equals_the_history_read(stream: str) -> None:
    events = [e for e in next(s for s in SCENARIOS if s.name == stream).events() if metric_points(e)]
    assert len(events) > 50
    # the recorded order, then every 9th envelope swapped with the 4th after it (late points) and every
    # 7th delivered again (a replay overwrites its points in place)
    order = list(events)
    for i in range(0, len(order) - 4, 9):
        order[i], order[i + 4] = order[i + 4], order[i]
    delivered = [e for i, e in enumerate(order) for _ in range(2 if i % 7 == 3 else 1)]
    ranks: Dict[int, RankState] = {}
    checked = nonfinite = late = 0
    for n, env in enumerate(delivered):
        rank = ranks.setdefault(int(env.get("rank", 0)), RankState(int(env.get("rank", 0))))
        points = metric_points(env)
        for name, step, value in points:
            late += step < max(rank.history.get(name, {step: None}), default=step)
            rank.observe_point(name, step, value, int(env.get("time_unix_nano", 0)), SMALL)
            nonfinite += value - value != 0.0
        for name, step, value in recent_points(env):
            rank.observe_point(name, step, value, 0, SMALL, context=True)
        step = max(s for _n, s, _v in points)
        for name in {p[0] for p in points}:
            for most, upto in itertools.product((1, 8, 40, 200), (None, step, step - 3)):
                assert recent(rank, name, most, upto) == _reference(rank, name, most, upto), \
                    (stream, n, name, most, upto)
                checked += 1
        if n % 97 == 0:  # a restored pipeline starts without tails
            ranks = {r: RankState.from_json(s.to_json()) for r, s in ranks.items()}
    assert checked > 1000 and late > 0
    if stream in ("explosion", "nan_source"):
        assert nonfinite > 0


@pytest.mark.parametrize("stream", STREAMS)
def test_a_trim_keeps_an_ordered_tail_as_its_slice(stream: str) -> None:
    """In the recorded order (steps only rise) a trim cuts the tail instead of dropping it: the tail
    survives every trim and still equals the history read, non-finite values included."""
    events = [e for e in next(s for s in SCENARIOS if s.name == stream).events() if metric_points(e)]
    rank = RankState(0)
    kept = checked = 0
    for env in events:
        points = metric_points(env)
        for name, step, value in points:
            before = rank.tails.get(name)
            floor = rank.history_floor.get(name)
            rank.observe_point(name, step, value, int(env.get("time_unix_nano", 0)), SMALL)
            if before is not None and rank.history_floor.get(name) != floor:  # this point trimmed
                assert rank.tails.get(name) is not None and rank.tails[name].data is rank.history[name]
                kept += 1
        step = max(s for _n, s, _v in points)
        for name in {p[0] for p in points}:
            for most, upto in itertools.product((1, 8, 16, 40), (None, step, step - 3)):
                assert recent(rank, name, most, upto) == _reference(rank, name, most, upto), (stream, name)
                checked += 1
    assert kept >= 5 and checked > 500
