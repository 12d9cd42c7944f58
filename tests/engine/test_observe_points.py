"""RankState.observe_points (one call an envelope, issue 15 stop 39; observe_point is one point of it) keeps
what the history's contract says, checked against a plain model of it: last write wins per step, a series
is trimmed to its last history_len steps when it reaches twice that, steps below a trim's floor are
ignored from then on, no new series past history_max_series, the first non-finite step and its time kept
-- and every tail kept beside a series is the tail rebuilt from that series (appended, dropped on a
replaced point, trimmed) -- on random envelopes with replays, late and non-finite points, trims and a full
series budget, in one call an envelope and in one call a point alike."""
from __future__ import annotations

import math
import random
from typing import Any, Dict, List, Tuple

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.state import RankState, SeriesTail

NAMES = ("loss", "lr", "grad/global_norm", "mem/allocated", "time/step_s")


class Model:
    """The history's contract, written plainly (no tails, no locals: a second reading of the rules)."""

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        self.series: Dict[str, Dict[int, Tuple[float, int]]] = {}
        self.floor: Dict[str, int] = {}
        self.first_bad: Dict[str, Tuple[int, int]] = {}

    def keep(self, name: str, step: int, value: float, time_ns: int) -> None:
        if name not in self.series and len(self.series) == self.settings.history_max_series:
            return
        points = self.series.setdefault(name, {})
        if step < self.floor.get(name, step):
            return
        points[step] = (value, time_ns)
        most = self.settings.history_len
        if len(points) > 2 * most:
            last = sorted(points)[len(points) - most:]
            self.floor[name] = last[0]
            self.series[name] = {k: points[k] for k in last}
        if not math.isfinite(value) and step < self.first_bad.get(name, (step + 1, 0))[0]:
            self.first_bad[name] = (step, time_ns)


def _canon(value: Any) -> Any:
    """``value`` with every NaN spelled ``"NaN"``: a compiled engine (engine/native_build.py) keeps floats
    unboxed and hands back a new NaN object each time, and containers compare NaN by identity first."""
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_canon(v) for v in value)
    return value


def _check(rank: RankState, model: Model) -> None:
    assert _canon(rank.history) == _canon(model.series)
    for name, points in rank.history.items():
        assert list(points) == list(model.series[name])  # the dicts' order too
    assert rank.history_floor == model.floor
    assert rank.first_nonfinite == model.first_bad
    for name, tail in rank.tails.items():  # a kept tail is the one its series would make now
        assert tail.data is rank.history[name]
        fresh = SeriesTail(rank.history[name])
        assert _canon((tail.points, tail.bad_end, tail.descent)) == \
            _canon((fresh.points, fresh.bad_end, fresh.descent))


def _value(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.03:
        return math.nan
    if roll < 0.05:
        return rng.choice((math.inf, -math.inf))
    return rng.uniform(-2.0, 5.0)


def test_observe_points_and_observe_point_keep_the_history_contract() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        settings = DetectionSettings(history_len=rng.choice((4, 8, 32)),
                                     history_max_series=rng.choice((2, 3, 64)))
        one, bulk, model = RankState(0), RankState(0), Model(settings)
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
                    model.keep(name, at, value, time_ns)
            bulk.observe_points(points, keep, time_ns, settings)
            if rng.random() < 0.1:  # a detector reads a series: its tail is made, then kept by both
                name = rng.choice(NAMES)
                for rank in (one, bulk):
                    if name in rank.history and name not in rank.tails:
                        rank.tails[name] = SeriesTail(rank.history[name])
            _check(one, model)
            _check(bulk, model)
