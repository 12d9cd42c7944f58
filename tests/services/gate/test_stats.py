"""gate.stats: robust statistics for 2-5 runs, and the constants the noise band relies on (re-derived by
seeded Monte Carlo, so a wrong constant fails here)."""

from __future__ import annotations

import math
import random

import pytest

from trainguard_server.gate import stats


def test_median_and_infinities() -> None:
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(stats.median([]))
    assert stats.median([1.0, math.inf]) == math.inf  # never averaged away
    assert stats.median([1.0, 2.0, math.inf]) == 2.0
    assert stats.median([-math.inf, 1.0]) == -math.inf


def test_scales() -> None:
    assert stats.pair_sigma([1.0]) == 0.0
    assert stats.pair_sigma([1.0, 3.0]) == pytest.approx(2.0 * stats.PAIR_DIFF_TO_SIGMA)
    assert stats.pair_sigma([5.0, 5.0, 5.0]) == 0.0
    # one wild run among five barely moves the pairwise median
    assert stats.pair_sigma([1.0, 1.1, 0.9, 1.05, 100.0]) < 0.5
    assert stats.mad_sigma([1.0, 2.0, 3.0, math.nan]) == pytest.approx(1.4826)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_pooled_pairwise_scale_is_consistent_for_any_number_of_runs(n: int) -> None:
    rng = random.Random(n)
    columns = [[rng.gauss(0.0, 2.0) for _ in range(n)] for _ in range(1000)]
    pooled = stats.pooled_pair_sigma(columns, half_width=500)
    assert pooled[500] == pytest.approx(2.0, rel=0.06)  # the middle point pools every column


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12])
def test_prediction_inflation_matches_monte_carlo(n: int) -> None:
    rng = random.Random(100 + n)
    diffs = []
    for _ in range(40_000):
        runs = [rng.gauss(0.0, 1.0) for _ in range(n)]
        diffs.append(rng.gauss(0.0, 1.0) - stats.median(runs))
    sd = math.sqrt(sum(d * d for d in diffs) / len(diffs))
    assert stats.prediction_inflation(n) == pytest.approx(sd, rel=0.02)


def test_running_median_keeps_a_mostly_infinite_window_infinite() -> None:
    ys = [1.0, 5.0, 1.0, 1.0, 1.0]
    assert stats.running_median(ys, 1) == [3.0, 1.0, 1.0, 1.0, 1.0]  # the spike is gone
    assert stats.running_median(ys, 0) == ys
    tail = [1.0, 1.0, 1.0, math.inf, math.inf, math.inf]
    assert stats.running_median(tail, 1)[-2:] == [math.inf, math.inf]


def test_interpolate() -> None:
    xs, ys = [0.0, 10.0, 20.0], [0.0, 1.0, math.inf]
    assert stats.interpolate(xs, ys, 5.0) == pytest.approx(0.5)
    assert stats.interpolate(xs, ys, 10.0) == 1.0
    assert stats.interpolate(xs, ys, 15.0) == math.inf
    assert math.isnan(stats.interpolate(xs, ys, 21.0))
    assert math.isnan(stats.interpolate([], [], 1.0))


def test_quantile() -> None:
    assert stats.quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.0) == 1.0
    assert stats.quantile([4.0, 1.0, 3.0, 2.0, 5.0], 1.0) == 5.0
    assert stats.quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert stats.quantile([1.0, 2.0, math.nan, math.inf], 0.5) == 1.5  # finite values only
    assert stats.quantile(list(map(float, range(11))), 0.1) == pytest.approx(1.0)
    assert math.isnan(stats.quantile([], 0.1))


def test_longest_run() -> None:
    assert stats.longest_run([False, True, True, False, True, True, True]) == (4, 3)
    assert stats.longest_run([False, False]) == (-1, 0)
    assert stats.longest_run([]) == (-1, 0)
