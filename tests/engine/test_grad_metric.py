"""``numeric.grad_metric`` -- the rank's global grad-norm metric -- answers as its list-building definition
does (issue 15: the usual single metric is found without building a list): none, one, or several of
``grad_norm_metrics`` in the history, the densest lately winning and ties going to the first listed."""

from __future__ import annotations

import itertools
import random
from typing import Optional

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import numeric
from trainguard_engine.state import RankState

SETTINGS = DetectionSettings()


def _definition(rank: RankState, settings: DetectionSettings) -> Optional[str]:
    present = [n for n in settings.grad_norm_metrics if n in rank.history]
    if len(present) <= 1:
        return present[0] if present else None
    best, best_density = present[0], -1.0
    for name in present:
        steps = list(itertools.islice(reversed(rank.history[name]), numeric.DENSITY_POINTS))
        density = len(steps) / (steps[0] - steps[-1] + 1) if steps else 0.0
        if density > best_density:
            best, best_density = name, density
    return best


def test_grad_metric_equals_its_definition() -> None:
    rng = random.Random(38)
    names = [*SETTINGS.grad_norm_metrics, "loss", "opt/lr"]
    assert len(SETTINGS.grad_norm_metrics) >= 2
    seen = set()
    for _ in range(400):
        rank = RankState(0)
        for name in rng.sample(names, rng.randint(0, len(names))):
            every = rng.choice((1, 1, 2, 5))
            for step in range(0, rng.randint(1, 60), every):
                rank.observe_point(name, step, 1.0 + step, step, SETTINGS)
        got = numeric.grad_metric(rank, SETTINGS)
        assert got == _definition(rank, SETTINGS)
        seen.add(sum(n in rank.history for n in SETTINGS.grad_norm_metrics))
    assert {0, 1, 2} <= seen
