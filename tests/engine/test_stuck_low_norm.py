"""loss._low_norm_recent: the kept "no grad-norm reading under plateau_small_grad among the last
STUCK_RECENT points" certificate lets _stuck_now skip recent() and the median -- its answer must be the
one it gives without the certificate, on streams with values about the threshold, ties, -0.0, NaN, +-inf,
late (out-of-order) and replaced points, trims (history_len) and both LR cases."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import List

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import loss
from trainguard_engine.state import RankState

SETTINGS = replace(DetectionSettings(), history_len=16)
SMALL = SETTINGS.plateau_small_grad


def _draw(rng: random.Random, mode: int) -> float:
    if mode == 0:
        return rng.choice([SMALL, SMALL * 0.999, SMALL * 1.001, 0.0, -0.0, 1.0, SMALL * 2])
    if mode == 1:
        r = rng.random()
        if r < 0.02:
            return rng.choice([math.nan, math.inf, -math.inf])
        return rng.uniform(0.0, 3 * SMALL)
    return rng.lognormvariate(0.0, 1.0) if rng.random() > 0.05 else rng.uniform(0.0, SMALL)


def _reference(rank: RankState, lo: int, hi: int) -> str:
    saved = loss._low_norm_recent
    loss._low_norm_recent = lambda *a: True  # type: ignore[assignment]
    try:
        return loss._stuck_now(rank, lo, hi, SETTINGS)
    finally:
        loss._low_norm_recent = saved  # type: ignore[assignment]


@pytest.mark.parametrize("seed", range(24))
def test_the_certificate_never_changes_the_reason(seed: int) -> None:
    rng = random.Random(seed)
    mode = seed % 3
    rank = RankState(0)
    gname = SETTINGS.grad_norm_metrics[seed % 2]
    step = 0
    answers: List[str] = []
    for i in range(400):
        r = rng.random()
        if r < 0.05 and step > 3:  # a late point (out of order) or a replaced one
            at = step - rng.randint(0, 3)
        else:
            step += rng.choice([1, 1, 1, 2, 3])
            at = step
        rank.observe_points(((gname, at, _draw(rng, mode)),), (True,), 1000 + i, SETTINGS)
        if seed % 4 == 0 and rng.random() < 0.3:
            rank.observe_points((("opt/lr", at, rng.choice([0.0, 0.1])),), (True,), 1000 + i, SETTINGS)
        hi = step - rng.choice([0, 0, 0, 1, 2])
        lo = hi - rng.choice([0, 3, 8, 40])
        got = loss._stuck_now(rank, lo, hi, SETTINGS)
        assert got == _reference(rank, lo, hi), (seed, i, lo, hi)
        answers.append(got)
    if mode != 2:
        assert "small" in answers  # the streams do reach the threshold


def test_a_kept_certificate_sees_a_new_low_reading() -> None:
    rank = RankState(0)
    gname = SETTINGS.grad_norm_metrics[0]
    rank.observe_points(((gname, 0, 1.0),), (True,), 0, SETTINGS)
    assert loss._low_norm_recent(rank, gname, SMALL)  # no tail yet: ask recent() (which makes one)
    loss.recent(rank, gname, loss.STUCK_RECENT)
    for s in range(1, 30):
        rank.observe_points(((gname, s, 1.0),), (True,), s, SETTINGS)
        assert not loss._low_norm_recent(rank, gname, SMALL)
    for s in range(30, 34):
        rank.observe_points(((gname, s, 0.0),), (True,), s, SETTINGS)
        assert loss._low_norm_recent(rank, gname, SMALL)
    for s in range(34, 34 + loss.STUCK_RECENT):
        assert loss._low_norm_recent(rank, gname, SMALL)
        rank.observe_points(((gname, s, 1.0),), (True,), s, SETTINGS)
    assert not loss._low_norm_recent(rank, gname, SMALL)  # the last low one left the last STUCK_RECENT
