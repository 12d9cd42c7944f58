"""MetricStore contract, written once against the ABC and run against every implementation.

Adding an implementation is one line in IMPLEMENTATIONS (factory: tmp_path, pytest request → empty store).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest

from trainguard_server.storage.base import Bucket, MetricColumns, MetricPoint, MetricStore
from trainguard_server.storage.clickhouse import ClickHouseMetricStore
from trainguard_server.storage.memory import MemoryMetricStore
from trainguard_server.storage.sqlite import SqliteMetricStore

Factory = Callable[[Path, pytest.FixtureRequest], MetricStore]
IMPLEMENTATIONS: Dict[str, Factory] = {
    # chDB (the ClickHouse engine in-process) through clickhouse-connect: one data directory per test (chDB
    # hosts one engine path per process at a time; the previous test's store closed its client, so a new
    # path opens).
    "clickhouse": lambda tmp_path, request: ClickHouseMetricStore.open(dsn=f"chdb://{tmp_path / 'ch'}"),
    "memory": lambda tmp_path, request: MemoryMetricStore(),
    "sqlite": lambda tmp_path, request: SqliteMetricStore(tmp_path / "metrics.db"),
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetricStore]:
    impl = IMPLEMENTATIONS[request.param](tmp_path, request)
    yield impl
    impl.close()


def pt(step: int, value: float, *, name: str = "loss", rank: int = 0, run_id: str = "r1",
       project: str = "p") -> MetricPoint:
    return MetricPoint(project=project, run_id=run_id, rank=rank, name=name, step=step, time_ns=1000 + step,
                       value=value)


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_bucket(b: Bucket, *, count: int, mn: float, mx: float, mean: float, last: float, nonfinite: int) -> None:
    assert b.count == count and b.nonfinite == nonfinite, b
    assert same(b.min, mn) and same(b.max, mx) and same(b.last, last), b
    assert same(b.mean, mean) or math.isclose(b.mean, mean, rel_tol=1e-12), b


def test_small_series_gets_a_bucket_per_step_with_exact_values(store: MetricStore) -> None:
    store.put([pt(s, s * 0.5) for s in range(10)])
    (buckets,) = store.series("p", "r1", ["loss"])["loss"].values()
    assert [(b.step_start, b.step_end) for b in buckets] == [(s, s) for s in range(10)]
    for s, b in enumerate(buckets):
        check_bucket(b, count=1, mn=s * 0.5, mx=s * 0.5, mean=s * 0.5, last=s * 0.5, nonfinite=0)


def test_a_point_with_the_same_key_replaces_the_old_one(store: MetricStore) -> None:
    store.put([pt(1, 1.0), pt(2, 2.0)])
    store.put([pt(1, 10.0)])
    store.put([pt(2, 20.0), pt(2, 200.0)])  # last one in a batch wins
    buckets = store.series("p", "r1", ["loss"])["loss"][0]
    assert [(b.step_start, b.count, b.last) for b in buckets] == [(1, 1, 10.0), (2, 1, 200.0)]
    (summary,) = store.summary("p", "r1")
    assert summary.count == 2


def test_nan_and_infinities_round_trip_faithfully(store: MetricStore) -> None:
    store.put([pt(0, 1.5), pt(1, math.nan), pt(2, math.inf), pt(3, -math.inf), pt(4, -0.0), pt(5, 1e308),
               pt(6, 5e-324)])
    buckets = store.series("p", "r1", ["loss"])["loss"][0]
    lasts = [b.last for b in buckets]
    assert lasts[0] == 1.5 and math.isnan(lasts[1]) and lasts[2] == math.inf and lasts[3] == -math.inf
    assert lasts[4] == 0.0 and math.copysign(1.0, lasts[4]) in (1.0, -1.0)
    assert lasts[5] == 1e308 and lasts[6] == 5e-324
    check_bucket(buckets[1], count=1, mn=math.nan, mx=math.nan, mean=math.nan, last=math.nan, nonfinite=1)
    check_bucket(buckets[2], count=1, mn=math.nan, mx=math.nan, mean=math.nan, last=math.inf, nonfinite=1)
    # one bucket over all of them: min/max/mean over the finite values, non-finite counted, last is last
    (whole,) = store.series("p", "r1", ["loss"], max_points=1)["loss"][0]
    check_bucket(whole, count=7, mn=0.0, mx=1e308, mean=(1.5 + 0.0 + 1e308 + 5e-324) / 4, last=5e-324,
                 nonfinite=3)
    (summary,) = store.summary("p", "r1")
    assert (summary.count, summary.nonfinite, summary.min, summary.max, summary.last) == (7, 3, 0.0, 1e308, 5e-324)


def test_a_non_finite_last_value_survives_in_the_summary(store: MetricStore) -> None:
    store.put([pt(0, 2.0), pt(1, 1.0), pt(2, math.nan)])
    (summary,) = store.summary("p", "r1")
    assert math.isnan(summary.last) and summary.nonfinite == 1 and summary.min == 1.0 and summary.max == 2.0
    store.put([pt(0, math.inf, name="only_inf")])
    inf_summary = {s.name: s for s in store.summary("p", "r1")}["only_inf"]
    assert inf_summary.last == math.inf and math.isnan(inf_summary.min) and math.isnan(inf_summary.max)


def test_downsampling_respects_max_points_and_keeps_spikes(store: MetricStore) -> None:
    values = {s: 1.0 + (s % 7) * 0.01 for s in range(10_000)}
    values[5123] = 1e6      # a spike
    values[8001] = -1e6     # a dip
    values[777] = math.nan  # a non-finite value
    store.put([pt(s, v) for s, v in values.items()])
    buckets = store.series("p", "r1", ["loss"], max_points=100)["loss"][0]
    assert len(buckets) == 100
    assert {b.step_end - b.step_start + 1 for b in buckets} == {100}  # equal widths
    assert sum(b.count for b in buckets) == 10_000
    assert max(b.max for b in buckets) == 1e6 and min(b.min for b in buckets) == -1e6
    spike = next(b for b in buckets if b.step_start <= 5123 <= b.step_end)
    assert spike.max == 1e6 and spike.min == 1.0
    dip = next(b for b in buckets if b.step_start <= 8001 <= b.step_end)
    assert dip.min == -1e6
    nan_bucket = next(b for b in buckets if b.step_start <= 777 <= b.step_end)
    assert nan_bucket.nonfinite == 1 and nan_bucket.count == 100 and math.isfinite(nan_bucket.mean)
    assert sum(b.nonfinite for b in buckets) == 1
    for b in buckets:
        assert b.last == values[b.step_end] or same(b.last, values[b.step_end])


@pytest.mark.parametrize("n, max_points", [(1001, 1000), (999, 1000), (12_345, 7), (10, 3), (1, 1), (5, 1)])
def test_bucket_count_never_exceeds_max_points(store: MetricStore, n: int, max_points: int) -> None:
    store.put([pt(s, float(s)) for s in range(n)])
    buckets = store.series("p", "r1", ["loss"], max_points=max_points)["loss"][0]
    assert 1 <= len(buckets) <= max_points
    assert sum(b.count for b in buckets) == n
    starts = [b.step_start for b in buckets]
    assert starts == sorted(starts)
    assert buckets[0].step_start == 0 and buckets[-1].step_end == n - 1


def test_sparse_series_leave_out_empty_buckets(store: MetricStore) -> None:
    store.put([pt(s, float(s)) for s in (0, 500, 100_000)])
    buckets = store.series("p", "r1", ["loss"], max_points=1000)["loss"][0]
    assert [(b.count, b.last) for b in buckets] == [(1, 0.0), (1, 500.0), (1, 100_000.0)]
    assert all(b.step_end - b.step_start + 1 == 101 for b in buckets[:-1])


def test_step_range_and_rank_filter(store: MetricStore) -> None:
    store.put([pt(s, float(s), rank=r) for s in range(100) for r in (0, 1, 3)])
    out = store.series("p", "r1", ["loss"], start_step=10, end_step=19)["loss"]
    assert sorted(out) == [0, 1, 3]
    assert [b.step_start for b in out[1]] == list(range(10, 20))
    only = store.series("p", "r1", ["loss"], rank=3, start_step=90)["loss"]
    assert list(only) == [3] and [b.last for b in only[3]] == [float(s) for s in range(90, 100)]
    assert store.series("p", "r1", ["loss"], start_step=500)["loss"] == {}
    assert store.series("p", "r1", ["loss"], start_step=50, end_step=40)["loss"] == {}
    assert store.series("p", "r1", ["loss"], rank=2)["loss"] == {}


def test_ranks_share_bucket_boundaries(store: MetricStore) -> None:
    store.put([pt(s, 1.0, rank=0) for s in range(0, 1000)] + [pt(s, 2.0, rank=1) for s in range(500, 1000)])
    out = store.series("p", "r1", ["loss"], max_points=10)["loss"]
    assert [b.step_start for b in out[0]] == list(range(0, 1000, 100))
    assert [b.step_start for b in out[1]] == list(range(500, 1000, 100))


def test_several_names_and_unknown_names(store: MetricStore) -> None:
    store.put([pt(s, 1.0, name=n) for s in range(5) for n in ("loss", "lr", "grad_norm")])
    out = store.series("p", "r1", ["lr", "loss", "missing"])
    assert list(out) == ["lr", "loss", "missing"]
    assert out["missing"] == {}
    assert len(out["lr"][0]) == 5


def test_names_are_sorted_and_scoped(store: MetricStore) -> None:
    store.put([pt(0, 1.0, name=n) for n in ("zeta", "alpha", "mid")] + [pt(0, 1.0, name="x", rank=5)])
    store.put([pt(0, 1.0, name="other_run", run_id="r2"), pt(0, 1.0, name="other_project", project="q")])
    assert store.names("p", "r1") == ["alpha", "mid", "x", "zeta"]
    assert store.names("p", "r2") == ["other_run"]
    assert store.names("q", "r1") == ["other_project"]
    assert store.names("nobody", "r1") == []


def test_projects_never_see_each_others_metrics(store: MetricStore) -> None:
    store.put([pt(s, 1.0, project="a") for s in range(5)])
    store.put([pt(s, 99.0, project="b") for s in range(3)])
    assert [b.last for b in store.series("a", "r1", ["loss"])["loss"][0]] == [1.0] * 5
    assert [b.last for b in store.series("b", "r1", ["loss"])["loss"][0]] == [99.0] * 3
    assert store.series("c", "r1", ["loss"])["loss"] == {}
    assert [s.count for s in store.summary("a", "r1")] == [5]
    assert store.summary("c", "r1") == []


def test_summary_aggregates_over_all_ranks(store: MetricStore) -> None:
    store.put([pt(s, float(s), rank=0) for s in range(10)] + [pt(s, -float(s), rank=1) for s in range(5, 12)] +
              [pt(3, 0.25, name="lr")])
    summaries = store.summary("p", "r1")
    assert [s.name for s in summaries] == ["loss", "lr"]
    loss = summaries[0]
    assert (loss.count, loss.first_step, loss.last_step, loss.min, loss.max, loss.last, loss.nonfinite) == (
        17, 0, 11, -11.0, 9.0, -11.0, 0)


@pytest.mark.parametrize("max_points", [0, -5])
def test_invalid_max_points_is_a_value_error(store: MetricStore, max_points: int) -> None:
    store.put([pt(0, 1.0)])
    with pytest.raises(ValueError):
        store.series("p", "r1", ["loss"], max_points=max_points)


MILLION, SPIKE_AT = 1_000_000, 654_321


@pytest.fixture(scope="module")
def million_points() -> List[MetricPoint]:
    return [MetricPoint("p", "big", 0, "loss", s, s, 100.0 if s == SPIKE_AT else 1.0) for s in range(MILLION)]


def test_one_million_points_downsample_to_max_points_and_keep_a_single_spike(
        store: MetricStore, million_points: List[MetricPoint]) -> None:
    """Bench-style: 1M steps in one put, then series() must return ≤ max_points buckets with the spike
    intact. No wall-clock assertion (SQLite here: put ~1.4 s, series() ~0.17 s, summary() ~0.2 s)."""
    n, spike_at = MILLION, SPIKE_AT
    store.put(million_points)
    buckets = store.series("p", "big", ["loss"], max_points=1000)["loss"][0]
    assert len(buckets) == 1000
    assert sum(b.count for b in buckets) == n
    spiky = [b for b in buckets if b.max == 100.0]
    assert len(spiky) == 1 and spiky[0].step_start <= spike_at <= spiky[0].step_end
    assert all(b.min == 1.0 for b in buckets)
    (summary,) = store.summary("p", "big")
    assert (summary.count, summary.max, summary.last_step) == (n, 100.0, n - 1)


def test_empty_put_is_a_no_op(store: MetricStore) -> None:
    store.put([])
    assert store.names("p", "r1") == []


def _all(buckets: Dict[int, List[Bucket]]) -> int:
    return sum(b.count for bs in buckets.values() for b in bs)


def test_negative_steps_are_bucketed_too(store: MetricStore) -> None:
    store.put([pt(s, float(s)) for s in range(-50, 50)])
    out = store.series("p", "r1", ["loss"], max_points=10)["loss"]
    assert _all(out) == 100 and out[0][0].step_start == -50 and out[0][-1].step_end == 49


def test_series_keys_size_a_query_before_it_runs(store: MetricStore) -> None:
    """Issue 18, finding 13: the API sizes a metrics answer from series_keys before asking for it."""
    store.put([pt(s, 1.0, name=n, rank=r) for n in ("loss", "lr", "grad/norm") for r in (0, 3) for s in range(5)]
              + [pt(0, 1.0, name="loss", rank=1), pt(0, 1.0, name="loss", run_id="r2", rank=7),
                 pt(0, 1.0, name="loss", project="q", rank=8)])
    assert store.series_keys("p", "r1", ["loss", "lr", "absent"]) == [
        ("loss", 0), ("loss", 1), ("loss", 3), ("lr", 0), ("lr", 3)]
    assert store.series_keys("p", "r1", ["loss", "grad/norm", "loss"], rank=3) == [("grad/norm", 3), ("loss", 3)]
    assert store.series_keys("p", "r1", []) == []
    assert store.series_keys("q", "r1", ["loss"]) == [("loss", 8)]
    expected = {(n, r) for n, by_rank in store.series("p", "r1", ["loss", "lr"]).items() for r in by_rank}
    assert set(store.series_keys("p", "r1", ["loss", "lr"])) == expected


def test_reads_under_a_generous_time_budget_are_unchanged(store: MetricStore) -> None:
    store.put([pt(s, float(s), rank=r) for r in (0, 1) for s in range(100)])
    plain = (store.series("p", "r1", ["loss"], max_points=7), store.summary("p", "r1"), store.names("p", "r1"))
    with store.time_budget(60.0):
        budgeted = (store.series("p", "r1", ["loss"], max_points=7), store.summary("p", "r1"),
                    store.names("p", "r1"))
    assert budgeted == plain


def test_put_columns_stores_what_put_stores(store: MetricStore) -> None:
    """The processor's write (a batch grouped by series, :class:`MetricColumns`) equals :meth:`put` of the
    same points: a repeated step's later value wins, non-finite values survive, ranks and runs stay apart."""
    points = ([pt(s, 1.0 / (s + 1), name=n, rank=r) for s in range(6) for r in (0, 2) for n in ("loss", "lr")]
              + [pt(3, math.nan, rank=2), pt(4, math.inf), pt(1, -math.inf, name="lr", rank=2), pt(3, 7.0)]
              + [pt(s, float(s), run_id="r2", rank=5) for s in (9, 2, 5)])
    store.put_columns(MetricColumns.of(points[:20]))
    store.put_columns(MetricColumns.of(points[20:]))
    store.put_columns(MetricColumns())  # empty: no-op
    reference = MemoryMetricStore()
    reference.put(points)
    for run_id in ("r1", "r2"):
        names = reference.names("p", run_id)
        assert store.names("p", run_id) == names
        got, want = store.series("p", run_id, names), reference.series("p", run_id, names)
        assert {n: sorted(by_rank) for n, by_rank in got.items()} == {n: sorted(b) for n, b in want.items()}
        for name, by_rank in want.items():
            for rank, buckets in by_rank.items():
                assert len(got[name][rank]) == len(buckets)
                for mine, theirs in zip(got[name][rank], buckets):
                    check_bucket(mine, count=theirs.count, mn=theirs.min, mx=theirs.max, mean=theirs.mean,
                                 last=theirs.last, nonfinite=theirs.nonfinite)
    assert store.series("p", "r1", ["loss"])["loss"][0][3].last == 7.0  # the later point of step 3 won
