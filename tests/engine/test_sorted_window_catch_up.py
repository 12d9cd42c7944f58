"""loss._sorted_window catches up several points at once (stop 40: an open plateau's window test may skip
points, loss._level_held): asked at irregular gaps -- 1 to more than the window's width points apart, with
the kept Mann-Kendall S asked for at some of them -- the sorted window equals sorted() of the tail's last
points bit for bit (ties, 0.0 / -0.0), and the kept trend equals robust.mann_kendall's."""

from __future__ import annotations

import random
from typing import List

import pytest

from trainguard_engine import robust
from trainguard_engine.detectors import loss
from trainguard_engine.state import SeriesTail


def _hex(values: List[float]) -> List[str]:
    return [float(v).hex() for v in values]


@pytest.mark.parametrize("seed", range(16))
def test_catching_up_equals_a_recount(seed: int) -> None:
    rng = random.Random(seed)
    width = rng.choice([16, 24, 40])
    tail = SeriesTail({})
    pool = [0.0, -0.0, 1.0, 1.5, 2.0, 2.5]
    checked = trends = 0
    step = 0
    while step < 900:
        for _ in range(rng.choice([1, 1, 1, 2, 3, 5, 9, width - 1, width, width + 3])):
            value = rng.choice(pool) if seed % 2 else rng.uniform(0.0, 3.0)
            tail.append(step, value, step)
            step += 1
        if len(tail.points) < width:
            continue
        values = [v for _s, v, _t in tail.points[-width:]]
        assert _hex(loss._sorted_window(tail, width)) == _hex(sorted(values)), (seed, step)
        checked += 1
        if rng.random() < 0.4:
            got = loss._kept_trend(tail, width)
            want = robust.mann_kendall(values)
            assert (got.n, got.s, got.z.hex(), got.tau.hex()) == (want.n, want.s, want.z.hex(), want.tau.hex())
            trends += 1
    assert checked > 50 and trends > 10
