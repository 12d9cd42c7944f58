"""Incremental snapshots (Pipeline.changed_parts / parts_saved / restore_parts): on every recorded stream,
parts saved after every call and restored at any point give exactly the state a whole snapshot gives
(byte-equal ``snapshot()``) and the same outputs from there on; a checkpoint writes only what changed."""

from __future__ import annotations

from typing import Dict, Optional

import pytest

from tests.engine.test_pipeline_golden import SETTLE_NS, STREAMS
from trainguard_engine.pipeline import Pipeline

Store = Dict[str, bytes]


def _save(pipeline: Pipeline, store: Store) -> Dict[str, Optional[bytes]]:
    """What a processor's checkpoint does: the changed parts into the store, atomically; then saved."""
    parts = pipeline.changed_parts()
    for key, value in parts.items():
        if value is None:
            store.pop(key, None)
        else:
            store[key] = value
    pipeline.parts_saved()
    return parts


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_restored_parts_equal_the_whole_snapshot_at_every_cut(name: str) -> None:
    load_events, settings = STREAMS[name]
    events = load_events()
    last = max(int(e.get("time_unix_nano") or 0) for e in events)
    pipeline = Pipeline(settings)
    store: Store = {}
    step = 25
    for i in range(0, len(events), step):
        pipeline.process(events[i:i + step])
        if i % (4 * step) == 0:
            pipeline.advance(int(events[min(i + step, len(events)) - 1].get("time_unix_nano") or 0))
        _save(pipeline, store)
        restored = Pipeline.restore_parts(store, settings)
        assert restored.snapshot() == pipeline.snapshot(), f"{name}: differs after event {i + step}"
    # and both go on alike: the settle-time timers, then a replay of the whole stream
    restored = Pipeline.restore_parts(store, settings)
    assert restored.advance(last + SETTLE_NS) == pipeline.advance(last + SETTLE_NS)
    assert restored.process(events) == pipeline.process(events)
    assert restored.snapshot() == pipeline.snapshot()


def test_a_checkpoint_writes_what_changed_and_deletes_what_went() -> None:
    load_events, settings = STREAMS["corpus/healthy_mlp"]
    events = load_events()
    other = [dict(e, run_id=e["run_id"] + "-b", event_id=e["event_id"] + "-b") for e in events]
    pipeline = Pipeline(settings)
    store: Store = {}
    pipeline.process(events + other)
    first = _save(pipeline, store)
    assert sorted(first) == ["header", *sorted(k for k in first if k.startswith("run/"))]
    assert len([k for k in first if k.startswith("run/")]) == 2
    pipeline.process(other[-3:])  # replayed events of one run: only that run is written again
    again = _save(pipeline, store)
    assert sorted(k for k in again if k.startswith("run/")) == [k for k in first if k.endswith("-b")]
    assert "\x00" not in "".join(store)  # part names are printable
    later = max(int(e["time_unix_nano"]) for e in events) + int(settings.ended_run_ttl_s * 1e9) + 10**9
    pipeline.advance(later)  # both runs ended long ago: evicted
    gone = _save(pipeline, store)
    assert sorted(k for k, v in gone.items() if v is None) == sorted(k for k in first if k.startswith("run/"))
    assert sorted(store) == ["header"]
    assert Pipeline.restore_parts(store, settings).snapshot() == pipeline.snapshot()


def test_creation_order_survives_for_runs_of_any_project_name() -> None:
    """Runs and clusters keep their creation order in separate sequences: a run key that looks like a
    cluster's (a project named "c...") keeps its place across saves."""
    load_events, settings = STREAMS["corpus/crash"]
    events = load_events()
    a = [dict(e, project="alpha") for e in events]
    b = [dict(e, project="cteam", run_id=e["run_id"] + "b", event_id=e["event_id"] + "b") for e in events]
    pipeline = Pipeline(settings)
    store: Store = {}
    half = len(events) // 2
    for chunk in (b[:half], a[:half], b[half:], a[half:]):
        pipeline.process(chunk)
        _save(pipeline, store)
        assert Pipeline.restore_parts(store, settings).snapshot() == pipeline.snapshot()


def test_parts_that_are_not_a_snapshot_are_refused() -> None:
    with pytest.raises(ValueError, match="no pipeline snapshot header"):
        Pipeline.restore_parts({"run/x": b"{}"})
    with pytest.raises(ValueError, match="unreadable"):
        Pipeline.restore_parts({"header": b"\xff"})
    with pytest.raises(ValueError, match="version 9"):
        Pipeline.restore_parts({"header": b'{"format": "trainguard.pipeline", "version": 9}'})
