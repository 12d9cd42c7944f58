"""The Flink runtime's two keyed stages as plain functions (processor/flink_stages.py), without Flink: state
pickled and restored after every record, as a checkpoint restore could do it at any point."""

from __future__ import annotations

import base64
import json
import pickle
from typing import Any, Dict, List, Optional

from tests.scenarios.corpus import BY_NAME
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.flink_stages import (
    ClusterStage,
    PipelineBox,
    RunStage,
    decode_record,
    events_of,
    is_observation,
    observation_key,
    run_key_of,
)

OVERRIDES = json.dumps({"stall_min_s": 5.0})
SETTINGS = DetectionSettings.from_overrides(json.loads(OVERRIDES))


def lines_of(events: List[Dict[str, Any]]) -> List[str]:
    """Stage-1 input lines of ``events`` sent in records of 50, as the gateway would queue them."""
    out: List[str] = []
    for i in range(0, len(events), 50):
        out += decode_record(wire.ingest_request_from_dicts(events[i:i + 50]).SerializeToString())
    return out


def test_decode_keys_each_runs_events_and_refuses_garbage() -> None:
    crash, healthy = BY_NAME["crash"].events()[:3], BY_NAME["healthy_mlp"].events()[:2]
    value = wire.ingest_request_from_dicts(crash + healthy).SerializeToString()
    decoded = decode_record(value)
    assert [[e["event_id"] for e in events_of(line)] for line in decoded] == \
        [[e["event_id"] for e in crash], [e["event_id"] for e in healthy]]  # one line per run, in order
    assert [run_key_of(line).split("\x00")[1] for line in decoded] == [crash[0]["run_id"], healthy[0]["run_id"]]
    assert decode_record(base64.b64encode(value).decode("ascii")) == decoded
    assert decode_record(b"\xff\x00not protobuf") == []


def test_run_stage_with_state_pickled_per_record_equals_one_pipeline() -> None:
    stage = RunStage(OVERRIDES)
    reference = Pipeline(SETTINGS)
    state: Optional[PipelineBox] = None
    incidents: Dict[str, dict] = {}
    events = BY_NAME["dist_rank_lost"].events()
    for line in lines_of(events):
        reference.process(events_of(line))
        state, out, last = stage.on_event(pickle.loads(pickle.dumps(state)) if state else None, line)
        assert last > 0
        for record in (json.loads(x) for x in out):
            if record["kind"] == "incident":
                incidents[record["record"]["incident_id"]] = record["record"]
    settle = max(e["time_unix_nano"] for e in events) + 60 * 10**9
    reference.advance(settle)
    state, out = stage.on_timer(state, settle)
    for record in (json.loads(x) for x in out):
        if record["kind"] == "incident":
            incidents[record["record"]["incident_id"]] = record["record"]
    assert incidents == {i.incident_id: i.to_dict() for i in reference.incidents()}
    assert any(i["subtype"] == "rank-lost" for i in incidents.values())  # the timer's decision


def test_only_counted_exceptions_become_observations_and_clusters_span_runs() -> None:
    stage, clusters = RunStage(OVERRIDES), ClusterStage(OVERRIDES)
    observations: List[str] = []
    for run in ("a", "b"):
        events = [dict(e, run_id=run) for e in BY_NAME["crash"].events()]
        state: Optional[PipelineBox] = None
        for _ in range(2):  # the whole run delivered twice: the redelivery must not count again
            for line in lines_of(events):
                state, out, _last = stage.on_event(state, line)
                observations += [x for x in out if is_observation(x)]
    assert len(observations) == 2  # one exception per run, its redelivery ignored
    assert len({observation_key(x) for x in observations}) == 1
    cluster_state: Optional[str] = None
    for observation in observations:
        cluster_state, out = clusters.on_observation(cluster_state, observation)
    record = json.loads(out[0])["record"]
    assert record["count"] == 2 and sorted(record["runs"]) == ["a", "b"]
