"""The Flink runtime's two keyed stages as plain functions (processor/flink_stages.py), without Flink: state
pickled and restored after every record, as a checkpoint restore could do it at any point (pending records
included), and records folded in batches of every size giving what one pipeline gives."""

from __future__ import annotations

import base64
import json
import pickle
from typing import Any, Dict, List, Optional, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.flink_stages import (
    ClusterStage,
    Flushed,
    PipelineBox,
    RunStage,
    decode_record,
    events_of,
    observation_key,
    run_key_of,
)

OVERRIDES = json.dumps({"stall_min_s": 5.0})
SETTINGS = DetectionSettings.from_overrides(json.loads(OVERRIDES))


def inputs_of(events: List[Dict[str, Any]]) -> List[Tuple[str, bytes]]:
    """Stage-1 inputs of ``events`` sent in records of 50, as the gateway would queue them."""
    out: List[Tuple[str, bytes]] = []
    for i in range(0, len(events), 50):
        out += decode_record(wire.ingest_request_from_dicts(events[i:i + 50]).SerializeToString())
    return out


def test_decode_keys_each_runs_events_and_refuses_garbage() -> None:
    crash, healthy = BY_NAME["crash"].events()[:3], BY_NAME["healthy_mlp"].events()[:2]
    value = wire.ingest_request_from_dicts(crash + healthy).SerializeToString()
    decoded = decode_record(value)
    assert [[e["event_id"] for e in events_of(payload)] for _, payload in decoded] == \
        [[e["event_id"] for e in crash], [e["event_id"] for e in healthy]]  # one input per run, in order
    assert [run_key_of(item).split("\x00")[1] for item in decoded] == [crash[0]["run_id"], healthy[0]["run_id"]]
    assert decode_record(base64.b64encode(value).decode("ascii")) == decoded
    assert decode_record(b"\xff\x00not protobuf") == []
    one = wire.ingest_request_from_dicts(crash).SerializeToString()
    assert decode_record(one) == [(run_key_of(decoded[0]), one)]  # one run: the record's own bytes


def incidents_in(out: Flushed, into: Dict[str, dict]) -> None:
    for record in (json.loads(x) for x in out.lines):
        if record["kind"] == "incident":
            into[record["record"]["incident_id"]] = record["record"]


@pytest.mark.parametrize("flush_events", [1, 7, 10_000])
def test_run_stage_with_state_pickled_per_record_equals_one_pipeline(flush_events: int) -> None:
    stage = RunStage(OVERRIDES, settle_ms=60_000, flush_events=flush_events)
    reference = Pipeline(SETTINGS)
    state: Optional[PipelineBox] = None
    incidents: Dict[str, dict] = {}
    events = BY_NAME["dist_rank_lost"].events()
    latest = 0
    for _, payload in inputs_of(events):
        reference.process(events_of(payload))
        box = stage.box(pickle.loads(pickle.dumps(state)) if state else None)
        out, last_ms = stage.on_record(box, payload)
        latest = max(latest, last_ms)
        incidents_in(out, incidents)
        state = box
    assert state is not None
    if flush_events in (1, 10_000):
        assert bool(state.pending) == (flush_events == 10_000)  # held until a flush, across the pickling
    settle = max(e["time_unix_nano"] for e in events) + 60 * 10**9
    assert latest + 60_000 >= settle // 1_000_000  # the wake-up is never before the settle time (ms)
    state = pickle.loads(pickle.dumps(state))
    out = stage.flush(state)
    incidents_in(out, incidents)
    assert state.due_ms == settle // 1_000_000  # the run's last event + settle (ms), known after the flush
    reference.advance(settle)
    incidents_in(stage.on_timer(state, settle), incidents)
    assert incidents == {i.incident_id: i.to_dict() for i in reference.incidents()}
    assert any(i["subtype"] == "rank-lost" for i in incidents.values())  # the timer's decision


def test_a_live_box_pickled_at_every_record_stores_what_a_whole_snapshot_holds() -> None:
    """The runtime pickles the live box at each bundle's end and goes on with it: each pickling merges only
    the parts that changed (a run re-encodes only its touched ranks), and what it stores restores, after
    every record of a multi-rank run, to the live pipeline's state byte for byte."""
    stage = RunStage(OVERRIDES, settle_ms=60_000, flush_events=1)
    events = BY_NAME["dist_rank_lost"].events()
    assert len({e["rank"] for e in events}) > 1
    box = stage.box(None)
    for _, payload in inputs_of(events):
        stage.on_record(box, payload)
        stored = pickle.dumps(box)
        assert pickle.loads(stored).pipeline.snapshot() == box.pipeline.snapshot()
        assert len(stored) < 1.05 * sum(map(len, box.parts.values())) + 4096  # plain bytes, no rank offsets
    assert not box.pipeline.changed_parts().keys() - {"header"}  # nothing unsaved after the last pickling


def test_only_counted_exceptions_become_observations_and_clusters_span_runs() -> None:
    stage, clusters = RunStage(OVERRIDES), ClusterStage(OVERRIDES)
    observations: List[str] = []
    for run in ("a", "b"):
        events = [dict(e, run_id=run) for e in BY_NAME["crash"].events()]
        box = stage.box(None)
        for _ in range(2):  # the whole run delivered twice: the redelivery must not count again
            for _, payload in inputs_of(events):
                out, _last = stage.on_record(box, payload)
                observations += out.observations
        observations += stage.flush(box).observations
    assert len(observations) == 2  # one exception per run, its redelivery ignored
    assert len({observation_key(x) for x in observations}) == 1
    cluster_state: Optional[str] = None
    for observation in observations:
        cluster_state, out = clusters.on_observation(cluster_state, observation)
    record = json.loads(out[0])["record"]
    assert record["count"] == 2 and sorted(record["runs"]) == ["a", "b"]
