"""The native reader's ``add_read`` (processor/_fastread.c): MetricColumns.add_with(add_points, ...) of each
plain batch's envelope in C, stopping at the first envelope it does not take -- what the processor's
_store_raw then handles as before. Its series, their order and every column value must be those of
MetricColumns.add envelope by envelope."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest

from tests.services.processor.test_fastread import native_on, reader  # noqa: F401 (fixtures)
from trainguard import wire
from trainguard.core import events as ev
from trainguard_server.processor import decode
from trainguard_server.storage.base import MetricColumns


def _identity(rank: int) -> dict:
    return {"project": "p", "run_id": "r", "trace_id": "r", "host": "h", "pid": 7, "rank": rank,
            "local_rank": rank, "world_size": 2, "run_name": "n", "sdk": "s"}


def _read(batch: List[dict]) -> Tuple[List[Any], List[Any]]:
    return decode.read_request(wire.prepare_batch(batch).request.SerializeToString())


def _columns(cols: MetricColumns) -> List[Any]:
    return [(key, [(name, c) for name, c in by_name.items()]) for key, by_name in cols.by_rank.items()]


def test_add_read_stops_at_what_it_does_not_take(native_on: Any) -> None:  # noqa: F811
    """Plain batches are added in order; a dict envelope (an alert here) stops it at its index, with the
    points added before it counted; called again after it, it goes on -- the result is MetricColumns.add's
    of every envelope in order (series created in arrival order, later points after earlier ones)."""
    envs, pts = _read([
        ev.envelope(_identity(0), "metrics", ev.metrics_payload({"loss": 1.0, "lr": 0.1}), step=1,
                    time_unix_nano=10, event_id="a"),
        ev.envelope(_identity(1), "metrics", ev.metrics_payload({"loss": 2.0}), step=1, time_unix_nano=11,
                    event_id="b"),
        ev.envelope(_identity(0), "metrics", {**ev.metrics_payload({"loss": 3.0}), "alert": "x"}, step=2,
                    time_unix_nano=12, event_id="c"),
        ev.envelope(_identity(0), "metrics", ev.metrics_payload({"loss": 4.0, "gpu": 5.0}), step=3,
                    time_unix_nano=13, event_id="d"),
    ])
    assert isinstance(envs[2], dict)  # the alert is not a plain batch: read_request gives its dict
    got = MetricColumns()
    assert native_on.add_read(got.by_rank, envs, pts, 0) == (2, 3)
    got.count += 3
    got.add("p", "r", 0, 12, pts[2])  # what _store_raw does with the dict envelope
    assert native_on.add_read(got.by_rank, envs, pts, 3) == (4, 2)
    got.count += 2
    want = MetricColumns()
    for env, mine in zip(envs, pts):
        if isinstance(env, dict):
            want.add("p", "r", 0, 12, mine)
        else:
            want.add(env.project, env.run_id, env.rank, env.time_ns, mine)
    assert _columns(got) == _columns(want) and got.count == want.count == 6
    assert native_on.add_read(got.by_rank, envs, pts, 4) == (4, 0)  # from the end: nothing


def test_add_read_skips_envelopes_without_points_and_refuses_what_add_points_refuses(
        native_on: Any) -> None:  # noqa: F811
    """An envelope with None or [] as its points adds nothing and does not stop it; one whose points are not
    a list of (str, step, value) tuples stops it there (the caller's add_points raises for it, as before);
    lists of two lengths, or not lists, are a TypeError."""
    envs, pts = _read([ev.envelope(_identity(0), "metrics", ev.metrics_payload({"loss": 1.0}), step=s,
                                   time_unix_nano=s, event_id=str(s)) for s in (1, 2, 3)])
    by_rank: dict = {}
    assert native_on.add_read(by_rank, envs, [None, [], pts[2]], 0) == (3, 1)
    assert list(by_rank) == [("p", "r", 0)]
    assert native_on.add_read({}, envs, [pts[0], [("loss", 2)], pts[2]], 0) == (1, 1)
    with pytest.raises(TypeError):
        native_on.add_read({}, envs, pts[:2], 0)
    with pytest.raises(TypeError):
        native_on.add_read({}, tuple(envs), pts, 0)
