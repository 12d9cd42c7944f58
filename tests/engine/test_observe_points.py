"""RankState.observe_points (one call an envelope, issue 15 stop 39) keeps exactly what observe_point keeps,
point by point: the history, its floors after a trim, the first non-finite values and the series' tails
(appended, dropped on a replaced point, trimmed) -- on random envelopes with replays, late and non-finite
points, trims and a full series budget."""
from __future__ import annotations

import math
import random
from typing import List, Tuple

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.state import RankState, SeriesTail

NAMES = ("loss", "lr", "grad/global_norm", "mem/allocated", "time/step_s")


def _tails(rank: RankState) -> dict:
    return {name: (tail.data is rank.history.get(name), list(tail.points), tail.bad_end, tail.descent)
            for name, tail in rank.tails.items()}


def _same(a: RankState, b: RankState) -> None:
    assert a.history == b.history
    assert list(a.history) == list(b.history)
    for name in a.history:
        assert list(a.history[name]) == list(b.history[name])  # the dicts' order too
    assert a.history_floor == b.history_floor
    assert a.first_nonfinite == b.first_nonfinite
    assert _tails(a) == _tails(b)


def _value(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.03:
        return math.nan
    if roll < 0.05:
        return rng.choice((math.inf, -math.inf))
    return rng.uniform(-2.0, 5.0)


def test_observe_points_is_observe_point_point_by_point() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        settings = DetectionSettings(history_len=rng.choice((4, 8, 32)),
                                     history_max_series=rng.choice((2, 3, 64)))
        one, bulk = RankState(0), RankState(0)
        step = 0
        for k in range(300):
            step += rng.choice((0, 1, 1, 1, 2))
            points: List[Tuple[str, int, float]] = []
            for name in rng.sample(NAMES, rng.randint(0, 4)):
                at = step - rng.choice((0, 0, 0, 1, 5, 40)) if rng.random() < 0.2 else step
                points.append((name, at, _value(rng)))
            if rng.random() < 0.1 and points:
                points.append(points[0])  # the same name twice in one envelope
            keep = [rng.random() < 0.85 for _ in points]
            time_ns = 1_000 + k
            for (name, at, value), kept in zip(points, keep):
                if kept:
                    one.observe_point(name, at, value, time_ns, settings)
            bulk.observe_points(points, keep, time_ns, settings)
            if rng.random() < 0.1:  # a detector reads a series: its tail is made, then kept by both
                name = rng.choice(NAMES)
                for rank in (one, bulk):
                    if name in rank.history and name not in rank.tails:
                        rank.tails[name] = SeriesTail(rank.history[name])
            _same(one, bulk)
