"""MetricStore on ClickHouse, through ``clickhouse-connect``.

Production points it at a ClickHouse server (``ClickHouseMetricStore.open(host=..., port=..., username=...,
password=..., secure=True)`` or a DSN such as ``https://user:pass@ch.example:8443``); the tests point the very
same client API at chDB, the ClickHouse engine in-process (``open(dsn="chdb:///some/dir")``). Every table
lives in one database (``trainguard`` unless told otherwise), created if absent.

Schema (see ``_schema``):

- ``metric_points`` — the points. ``ReplacingMergeTree(version)`` ordered by
  ``(project, run_id, name, rank, step)``, so one series is one contiguous range of the primary key and a
  point written again with the same key replaces the old one: every read of points says ``FINAL``.
  ``version`` is the wall clock in nanoseconds at ``put``, strictly increasing within a store, so the last
  write wins; duplicates inside one batch are removed in Python first (the last one wins, as in the other
  stores). NaN and ±Inf are ordinary Float64 values and are stored as they are. ``ingested_at`` (server
  time) drives the TTL (``retention_days``) and the monthly partitions that the TTL drops.
- ``metric_series`` — per (project, run, name, rank): first and last step, via a materialized view into an
  ``AggregatingMergeTree`` (min/max are idempotent, so this one stays exact under replays). It answers
  ``names()``, the step range ``series()`` buckets over, and the overlap check of ``put``.
- ``metric_run_agg`` — per (project, run, name): count, non-finite count, min/max of the finite values,
  first/last step and the last value (``argMax(value, (step, -rank))``: highest step, lowest rank), via a
  materialized view into an ``AggregatingMergeTree``. ``summary()`` reads it.
- ``metric_minute_agg`` — the same per minute of the points' ``time_ns`` plus the sum of finite values (so a
  mean), for dashboards: ``minutes()``.
- ``metric_dirty`` — (project, run, name) whose aggregates may count a replaced point twice. Materialized
  views see every inserted row, so a point written again (a batch applied twice after a crash, a run resumed
  from a checkpoint) would be counted twice and its old value would stay in min/max. ``put`` therefore
  checks each batch against ``metric_series``: when a series receives a step at or below the last step it
  already has, its name is marked dirty (before the points are written), and ``summary()``/``minutes()``
  compute that name exactly from ``metric_points FINAL`` instead. Append-only series — the normal case —
  are answered from the aggregates. Marks have no TTL (they must outlive the rows they distrust). The check
  assumes one writer per run at a time, as the processor has (the queue is keyed by run).

``series()`` downsamples inside ClickHouse: one ``GROUP BY rank, intDiv(step - lo, width)`` per name
(``UNION ALL``, one round trip) over ``metric_points FINAL``, with count, non-finite count, min/max/sum of
the finite values and ``argMax(value, step)`` per bucket, so spikes and non-finite values survive; empty
buckets are simply absent. Bucket bounds are the same equal-width ones as every other store
(:func:`~trainguard_server.storage.memory.bucket_width` over one range shared by all ranks).

Inserts are one ``INSERT`` per ``put`` (column-oriented, Native format), with ``async_insert=0`` so that the
views have seen a batch before the next one is checked.

Caveats: the aggregates forget nothing when the TTL removes old points of a run that is still being
written (a run's aggregate rows expire ``retention_days`` after its last write); the views are created
after their tables, so views added to a table that already holds points do not see those points; a
cluster deployment wants the ``Replicated*`` engines and ``ON CLUSTER`` DDL, which this module does not
emit.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import Bucket, MetricPoint, MetricStore, MetricSummary
from .common import bucket_width

DEFAULT_DATABASE = "trainguard"
DEFAULT_RETENTION_DAYS = 90

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_POINT_COLUMNS = ["project", "run_id", "name", "rank", "step", "time_ns", "value", "version"]
_POINT_TYPES = ["LowCardinality(String)", "String", "LowCardinality(String)", "Int32", "Int64", "Int64",
                "Float64", "UInt64"]
_DIRTY_COLUMNS = ["project", "run_id", "name"]
_DIRTY_TYPES = ["LowCardinality(String)", "String", "LowCardinality(String)"]
_INT32 = (-(2 ** 31), 2 ** 31 - 1)
_INT64 = (-(2 ** 63), 2 ** 63 - 1)

SeriesKey = Tuple[str, str, str, int]  # (project, run_id, name, rank)

# SQL fragments shared by the views and the exact (dirty-name) queries, so both compute the same thing.
_FINITE_MIN = "min(if(isFinite(value), value, inf))"    # +inf when no value is finite: read back as NaN
_FINITE_MAX = "max(if(isFinite(value), value, -inf))"
_FINITE_SUM = "sumIf(value, isFinite(value))"
_NONFINITE = "countIf(NOT isFinite(value))"
_LAST = "(step, -toInt64(rank))"                        # argMax key: highest step, lowest rank on ties
_MINUTE = ("toStartOfMinute(toDateTime(toUInt32(least(greatest(intDiv(time_ns, 1000000000), 0), "
           "4294967295)), 'UTC'))")
# the tables with a TTL, and the column it counts from (metric_dirty has none: see _schema)
_TTL_COLUMNS = {"metric_points": "ingested_at", "metric_series": "updated_at", "metric_run_agg": "updated_at",
                "metric_minute_agg": "updated_at"}


@dataclass
class MinuteAggregate:
    """One minute (by the points' ``time_ns``) of one metric of a run, over all ranks."""

    minute_ns: int             # start of the minute, nanoseconds since the epoch (UTC)
    count: int
    min: float                 # of the finite values; NaN if none
    max: float
    mean: float
    last: float                # value at the highest step (lowest rank on ties), NaN/Inf as is
    nonfinite: int
    first_step: int
    last_step: int


def _schema(db: str, retention_days: int) -> List[str]:
    """DDL, in order: tables first, then the materialized views that feed the aggregate tables."""
    keep = retention_days > 0
    ttl_points = f" TTL ingested_at + INTERVAL {retention_days} DAY" if keep else ""
    ttl_agg = f" TTL updated_at + INTERVAL {retention_days} DAY" if keep else ""
    finite_min, finite_max, last, minute = _FINITE_MIN, _FINITE_MAX, f"argMaxState(value, {_LAST})", _MINUTE
    nonfinite, finite_sum = _NONFINITE, _FINITE_SUM
    return [
        f"CREATE DATABASE IF NOT EXISTS {db}",
        f"""CREATE TABLE IF NOT EXISTS {db}.metric_points (
            project      LowCardinality(String),
            run_id       String,
            name         LowCardinality(String),
            rank         Int32,
            step         Int64 CODEC(Delta, LZ4),
            time_ns      Int64 CODEC(Delta, LZ4),
            value        Float64 CODEC(Gorilla, LZ4),
            version      UInt64,
            ingested_at  DateTime('UTC') DEFAULT now()
        ) ENGINE = ReplacingMergeTree(version)
        PARTITION BY toYYYYMM(ingested_at)
        ORDER BY (project, run_id, name, rank, step){ttl_points}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.metric_series (
            project     LowCardinality(String),
            run_id      String,
            name        LowCardinality(String),
            rank        Int32,
            min_step    SimpleAggregateFunction(min, Int64),
            max_step    SimpleAggregateFunction(max, Int64),
            updated_at  SimpleAggregateFunction(max, DateTime('UTC'))
        ) ENGINE = AggregatingMergeTree
        ORDER BY (project, run_id, name, rank){ttl_agg}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.metric_run_agg (
            project     LowCardinality(String),
            run_id      String,
            name        LowCardinality(String),
            points      SimpleAggregateFunction(sum, UInt64),
            nonfinite   SimpleAggregateFunction(sum, UInt64),
            min_value   SimpleAggregateFunction(min, Float64),
            max_value   SimpleAggregateFunction(max, Float64),
            first_step  SimpleAggregateFunction(min, Int64),
            last_step   SimpleAggregateFunction(max, Int64),
            last_value  AggregateFunction(argMax, Float64, Tuple(Int64, Int64)),
            updated_at  SimpleAggregateFunction(max, DateTime('UTC'))
        ) ENGINE = AggregatingMergeTree
        ORDER BY (project, run_id, name){ttl_agg}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.metric_minute_agg (
            project     LowCardinality(String),
            run_id      String,
            name        LowCardinality(String),
            minute      DateTime('UTC'),
            points      SimpleAggregateFunction(sum, UInt64),
            nonfinite   SimpleAggregateFunction(sum, UInt64),
            min_value   SimpleAggregateFunction(min, Float64),
            max_value   SimpleAggregateFunction(max, Float64),
            sum_finite  SimpleAggregateFunction(sum, Float64),
            first_step  SimpleAggregateFunction(min, Int64),
            last_step   SimpleAggregateFunction(max, Int64),
            last_value  AggregateFunction(argMax, Float64, Tuple(Int64, Int64)),
            updated_at  SimpleAggregateFunction(max, DateTime('UTC'))
        ) ENGINE = AggregatingMergeTree
        ORDER BY (project, run_id, name, minute){ttl_agg}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.metric_dirty (
            project    LowCardinality(String),
            run_id     String,
            name       LowCardinality(String),
            marked_at  DateTime('UTC') DEFAULT now()
        ) ENGINE = ReplacingMergeTree(marked_at)
        ORDER BY (project, run_id, name)""",  # no TTL: a mark must outlive the rows it distrusts
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.metric_series_mv TO {db}.metric_series AS
        SELECT project, run_id, name, rank, min(step) AS min_step, max(step) AS max_step,
               max(ingested_at) AS updated_at
        FROM {db}.metric_points GROUP BY project, run_id, name, rank""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.metric_run_agg_mv TO {db}.metric_run_agg AS
        SELECT project, run_id, name, count() AS points, {nonfinite} AS nonfinite,
               {finite_min} AS min_value, {finite_max} AS max_value, min(step) AS first_step,
               max(step) AS last_step, {last} AS last_value, max(ingested_at) AS updated_at
        FROM {db}.metric_points GROUP BY project, run_id, name""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.metric_minute_agg_mv TO {db}.metric_minute_agg AS
        SELECT project, run_id, name, {minute} AS minute, count() AS points,
               {nonfinite} AS nonfinite, {finite_min} AS min_value,
               {finite_max} AS max_value, {finite_sum} AS sum_finite,
               min(step) AS first_step, max(step) AS last_step,
               {last} AS last_value, max(ingested_at) AS updated_at
        FROM {db}.metric_points GROUP BY project, run_id, name, minute""",
    ]


def _finite_or_nan(value: float, finite: int) -> float:
    return float(value) if finite > 0 else math.nan


class ClickHouseMetricStore(MetricStore):
    """Metric points and their aggregates in ClickHouse (module docstring: schema, downsampling, caveats).

    ``client`` is a ``clickhouse_connect`` client (HTTP to a server, or chDB in-process); the store closes it
    on :meth:`close` when ``owns_client``. Safe to share between threads: ``put`` holds a lock across its
    check-and-insert; reads go straight to the client (the HTTP client without a session id, chDB's client
    serializes its own calls).
    """

    def __init__(self, client: Any, *, database: str = DEFAULT_DATABASE,
                 retention_days: int = DEFAULT_RETENTION_DAYS, create_schema: bool = True,
                 owns_client: bool = False) -> None:
        if not _IDENTIFIER.match(database):
            raise ValueError(f"ClickHouse database name must match {_IDENTIFIER.pattern}, not {database!r}")
        if isinstance(retention_days, bool) or not isinstance(retention_days, int) or retention_days < 0:
            raise ValueError(f"retention_days must be a non-negative integer (0: keep forever), "
                             f"not {retention_days!r}")
        self._client = client
        self._db = database
        self._retention_days = retention_days
        self._owns_client = owns_client
        self._lock = threading.Lock()
        self._last_version = 0
        self._closed = False
        if create_schema:
            self.create_schema()

    @classmethod
    def open(cls, dsn: Optional[str] = None, *, host: Optional[str] = None, port: Optional[int] = None,
             username: Optional[str] = None, password: Optional[str] = None, secure: bool = False,
             database: str = DEFAULT_DATABASE, retention_days: int = DEFAULT_RETENTION_DAYS,
             create_schema: bool = True, **client_kwargs: Any) -> ClickHouseMetricStore:
        """Connect with ``clickhouse_connect.get_client``: a DSN (``chdb:///dir`` for the in-process engine,
        ``http[s]://user:password@host:port``) and/or host/port/username/password/secure; other keyword
        arguments go to ``get_client`` as they are (timeouts, TLS files, ...). The tables go to ``database``,
        created if absent (leave the database out of the DSN: the client would need it to exist already)."""
        import clickhouse_connect  # the optional extra "clickhouse"

        if dsn is not None and dsn.startswith("chdb:"):
            client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs)
        else:
            args: Dict[str, Any] = {"secure": secure, "autogenerate_session_id": False, **client_kwargs}
            for key, value in (("dsn", dsn), ("host", host), ("port", port), ("username", username),
                               ("password", password)):
                if value is not None:
                    args[key] = value
            client = clickhouse_connect.get_client(**args)
        try:
            return cls(client, database=database, retention_days=retention_days, create_schema=create_schema,
                       owns_client=True)
        except BaseException:
            client.close()
            raise

    # ------------------------------------------------------------------------------------------------------
    # schema
    # ------------------------------------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the database, tables and views if absent, and bring the tables' TTL in line with
        ``retention_days`` (``ALTER ... MODIFY/REMOVE TTL`` only when it differs)."""
        for statement in _schema(self._db, self._retention_days):
            self._client.command(statement)
        self._sync_ttl()

    def _sync_ttl(self) -> None:
        rows = self._client.query(
            "SELECT name, engine_full FROM system.tables "
            "WHERE database = {db:String} AND name IN {names:Array(String)}",
            parameters={"db": self._db, "names": list(_TTL_COLUMNS)}).result_rows
        want = f"toIntervalDay({self._retention_days})"
        for table, engine_full in rows:
            has_ttl = " TTL " in f" {engine_full} "
            if self._retention_days > 0 and (not has_ttl or want not in engine_full):
                self._client.command(f"ALTER TABLE {self._db}.{table} MODIFY TTL {_TTL_COLUMNS[table]} + "
                                     f"INTERVAL {self._retention_days} DAY")
            elif self._retention_days == 0 and has_ttl:
                self._client.command(f"ALTER TABLE {self._db}.{table} REMOVE TTL")

    # ------------------------------------------------------------------------------------------------------
    # writes
    # ------------------------------------------------------------------------------------------------------

    def put(self, points: Sequence[MetricPoint]) -> None:
        if not points:
            return
        self._check_open()
        points, ranges = _last_write_wins(points)
        columns: List[List[Any]] = [
            [p.project for p in points], [p.run_id for p in points], [p.name for p in points],
            [int(p.rank) for p in points], [int(p.step) for p in points], [int(p.time_ns) for p in points],
            [float(p.value) for p in points]]
        for what, column, bounds in (("rank", columns[3], _INT32), ("step", columns[4], _INT64),
                                     ("time_ns", columns[5], _INT64)):
            if min(column) < bounds[0] or max(column) > bounds[1]:
                raise ValueError(f"{what} out of range for ClickHouse ({bounds[0]}..{bounds[1]})")
        with self._lock:
            dirty = self._overlapping(ranges)
            if dirty:  # marked before the points land: a crash in between leaves a (harmless) mark
                rows = sorted(dirty)
                self._client.insert(f"{self._db}.metric_dirty", rows, column_names=_DIRTY_COLUMNS,
                                    column_type_names=_DIRTY_TYPES)
            version = max(time.time_ns(), self._last_version + 1)
            self._last_version = version
            columns.append([version] * len(points))
            self._client.insert(f"{self._db}.metric_points", columns, column_names=_POINT_COLUMNS,
                                column_type_names=_POINT_TYPES, column_oriented=True,
                                settings={"async_insert": 0})

    def _overlapping(self, ranges: Dict[SeriesKey, List[int]]) -> set[Tuple[str, str, str]]:
        """(project, run, name) of the series in ``ranges`` that already hold a step at or above the batch's
        first step: writing them may replace points that the aggregates have already counted."""
        runs = sorted({(k[0], k[1]) for k in ranges})
        stored = self._client.query(
            f"SELECT project, run_id, name, rank, max(max_step) FROM {self._db}.metric_series "
            "WHERE (project, run_id) IN {runs:Array(Tuple(String, String))} "
            "GROUP BY project, run_id, name, rank",
            parameters={"runs": runs}).result_rows
        dirty = set()
        for project, run_id, name, rank, max_step in stored:
            bounds = ranges.get((project, run_id, name, int(rank)))
            if bounds is not None and bounds[0] <= int(max_step):
                dirty.add((project, run_id, name))
        return dirty

    # ------------------------------------------------------------------------------------------------------
    # reads
    # ------------------------------------------------------------------------------------------------------

    def names(self, project: str, run_id: str) -> List[str]:
        self._check_open()
        rows = self._client.query(
            f"SELECT DISTINCT name FROM {self._db}.metric_series "
            "WHERE project = {project:String} AND run_id = {run_id:String} ORDER BY name",
            parameters={"project": project, "run_id": run_id}).result_rows
        return [r[0] for r in rows]

    def series(self, project: str, run_id: str, names: Sequence[str], *, rank: Optional[int] = None,
               start_step: Optional[int] = None, end_step: Optional[int] = None,
               max_points: int = 1000) -> Dict[str, Dict[int, List[Bucket]]]:
        bucket_width(0, 0, max_points)  # validates max_points
        self._check_open()
        wanted = list(dict.fromkeys(names))
        out: Dict[str, Dict[int, List[Bucket]]] = {name: {} for name in wanted}
        if not wanted or (rank is not None and not _INT32[0] <= int(rank) <= _INT32[1]):
            return out
        params: Dict[str, Any] = {"project": project, "run_id": run_id, "names": wanted}
        rank_filter = ""
        if rank is not None:
            rank_filter = " AND rank = {rank:Int32}"
            params["rank"] = int(rank)
        extents = self._client.query(
            f"SELECT name, min(min_step), max(max_step) FROM {self._db}.metric_series "
            "WHERE project = {project:String} AND run_id = {run_id:String} AND name IN {names:Array(String)}"
            f"{rank_filter} GROUP BY name", parameters=params).result_rows
        plans: Dict[str, Tuple[int, int, int]] = {}
        selects: List[str] = []
        for i, (name, first, last) in enumerate(sorted(extents)):
            lo = _clamp64(start_step) if start_step is not None else int(first)
            hi = _clamp64(end_step) if end_step is not None else int(last)
            if lo > hi:
                continue
            width = bucket_width(lo, hi, max_points)
            plans[name] = (lo, hi, width)
            params.update({f"n{i}": name, f"lo{i}": lo, f"hi{i}": hi, f"w{i}": width})
            selects.append(
                f"SELECT name, rank, intDiv(step - {{lo{i}:Int64}}, {{w{i}:Int64}}) AS b, count(), "
                f"{_NONFINITE}, {_FINITE_MIN}, {_FINITE_MAX}, {_FINITE_SUM}, argMax(value, step) "
                f"FROM {self._db}.metric_points FINAL "
                "WHERE project = {project:String} AND run_id = {run_id:String} "
                f"AND name = {{n{i}:String}}{rank_filter} "
                f"AND step >= {{lo{i}:Int64}} AND step <= {{hi{i}:Int64}} "
                "GROUP BY name, rank, b")
        if not selects:
            return out
        rows = self._client.query(" UNION ALL ".join(selects), parameters=params).result_rows
        for row in sorted(rows, key=_bucket_order):
            name, series_rank, index, count, nonfinite, mn, mx, total, last = row
            lo, hi, width = plans[name]
            finite = int(count) - int(nonfinite)
            start = lo + int(index) * width
            out[name].setdefault(int(series_rank), []).append(Bucket(
                step_start=start, step_end=min(start + width - 1, hi), count=int(count),
                min=_finite_or_nan(mn, finite), max=_finite_or_nan(mx, finite),
                mean=float(total) / finite if finite else math.nan, last=float(last),
                nonfinite=int(nonfinite)))
        return out

    def summary(self, project: str, run_id: str) -> List[MetricSummary]:
        """From ``metric_run_agg``; names marked dirty (see module docstring) exactly from the points."""
        self._check_open()
        db = self._db
        rows = self._client.query(
            f"""WITH dirty AS (SELECT name FROM {db}.metric_dirty
                               WHERE project = {{project:String}} AND run_id = {{run_id:String}})
            SELECT name, sum(points), sum(nonfinite), min(min_value), max(max_value), min(first_step),
                   max(last_step), argMaxMerge(last_value)
            FROM {db}.metric_run_agg
            WHERE project = {{project:String}} AND run_id = {{run_id:String}} AND name NOT IN dirty
            GROUP BY name
            UNION ALL
            SELECT name, count(), {_NONFINITE}, {_FINITE_MIN}, {_FINITE_MAX}, min(step), max(step),
                   argMax(value, {_LAST})
            FROM {db}.metric_points FINAL
            WHERE project = {{project:String}} AND run_id = {{run_id:String}} AND name IN dirty
            GROUP BY name""",
            parameters={"project": project, "run_id": run_id}).result_rows
        out = []
        for name, count, nonfinite, mn, mx, first, last_step, last in sorted(rows, key=lambda r: r[0]):
            finite = int(count) - int(nonfinite)
            out.append(MetricSummary(name=name, count=int(count), first_step=int(first),
                                     last_step=int(last_step), min=_finite_or_nan(mn, finite),
                                     max=_finite_or_nan(mx, finite), last=float(last),
                                     nonfinite=int(nonfinite)))
        return out

    def minutes(self, project: str, run_id: str, name: str) -> List[MinuteAggregate]:
        """Per-minute aggregates of one metric over all ranks, oldest first, from ``metric_minute_agg``
        (exactly from the points when the name is marked dirty)."""
        self._check_open()
        db = self._db
        where = "project = {project:String} AND run_id = {run_id:String} AND name = {name:String}"
        rows = self._client.query(
            f"""WITH dirty AS (SELECT name FROM {db}.metric_dirty WHERE {where})
            SELECT toUnixTimestamp(minute) AS m, sum(points), sum(nonfinite), min(min_value), max(max_value),
                   sum(sum_finite), min(first_step), max(last_step), argMaxMerge(last_value)
            FROM {db}.metric_minute_agg WHERE {where} AND name NOT IN dirty GROUP BY minute
            UNION ALL
            SELECT toUnixTimestamp({_MINUTE}) AS m, count(), {_NONFINITE}, {_FINITE_MIN}, {_FINITE_MAX},
                   {_FINITE_SUM}, min(step), max(step), argMax(value, {_LAST})
            FROM {db}.metric_points FINAL WHERE {where} AND name IN dirty GROUP BY m""",
            parameters={"project": project, "run_id": run_id, "name": name}).result_rows
        out = []
        for m, count, nonfinite, mn, mx, total, first, last_step, last in sorted(rows, key=lambda r: r[0]):
            finite = int(count) - int(nonfinite)
            out.append(MinuteAggregate(minute_ns=int(m) * 1_000_000_000, count=int(count),
                                       min=_finite_or_nan(mn, finite), max=_finite_or_nan(mx, finite),
                                       mean=float(total) / finite if finite else math.nan, last=float(last),
                                       nonfinite=int(nonfinite), first_step=int(first),
                                       last_step=int(last_step)))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ClickHouseMetricStore is closed")


def _last_write_wins(
        points: Sequence[MetricPoint]) -> Tuple[Sequence[MetricPoint], Dict[SeriesKey, List[int]]]:
    """``points`` without earlier duplicates of a (project, run, name, rank, step) key (the last one wins,
    as in the other stores), and each series' [first, last] step in the batch. One pass when every series
    comes in increasing step order, as it usually does; a dict of all keys only otherwise."""
    ranges: Dict[SeriesKey, List[int]] = {}
    for p in points:
        key = (p.project, p.run_id, p.name, int(p.rank))
        bounds = ranges.get(key)
        if bounds is None:
            ranges[key] = [int(p.step), int(p.step)]
        elif p.step > bounds[1]:
            bounds[1] = int(p.step)
        else:
            break
    else:
        return points, ranges
    latest: Dict[Tuple[str, str, str, int, int], MetricPoint] = {}
    for p in points:
        key5 = (p.project, p.run_id, p.name, int(p.rank), int(p.step))
        latest.pop(key5, None)  # re-inserted: the order is that of the last occurrence
        latest[key5] = p
    ranges = {}
    for project, run_id, name, rank, step in latest:
        bounds = ranges.get((project, run_id, name, rank))
        if bounds is None:
            ranges[(project, run_id, name, rank)] = [step, step]
        else:
            bounds[0], bounds[1] = min(bounds[0], step), max(bounds[1], step)
    return list(latest.values()), ranges


def _clamp64(value: int) -> int:
    return min(max(int(value), _INT64[0]), _INT64[1])


def _bucket_order(row: Sequence[Any]) -> Tuple[str, int, int]:
    return row[0], int(row[1]), int(row[2])


__all__ = ["DEFAULT_DATABASE", "DEFAULT_RETENTION_DAYS", "ClickHouseMetricStore", "MinuteAggregate"]
