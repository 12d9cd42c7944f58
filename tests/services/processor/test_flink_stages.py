"""The Flink runtime's two keyed stages as plain functions (processor/flink_stages.py), without Flink: state
round-trips through bytes on every event, exactly as the job's keyed state holds it."""

from __future__ import annotations

import base64
import json
import pickle
from typing import Dict, List, Optional

from tests.scenarios.corpus import BY_NAME
from trainguard import wire
from trainguard.core.catalogue import DetectionSettings
from trainguard.core.pipeline import Pipeline
from trainguard_server.processor.flink_stages import (
    ClusterStage,
    PipelineBox,
    RunStage,
    decode_record,
    is_observation,
    observation_key,
    run_key_of,
)

OVERRIDES = json.dumps({"stall_min_s": 5.0})
SETTINGS = DetectionSettings.from_overrides(json.loads(OVERRIDES))


def lines_of(name: str) -> List[str]:
    events = BY_NAME[name].events()
    out: List[str] = []
    for i in range(0, len(events), 50):
        out += decode_record(wire.ingest_request_from_dicts(events[i:i + 50]).SerializeToString())
    return out


def test_decode_reads_bytes_and_base64_and_refuses_garbage() -> None:
    events = BY_NAME["crash"].events()[:3]
    value = wire.ingest_request_from_dicts(events).SerializeToString()
    decoded = decode_record(value)
    assert [json.loads(line)["event_id"] for line in decoded] == [e["event_id"] for e in events]
    assert decode_record(base64.b64encode(value).decode("ascii")) == decoded
    assert decode_record(b"\xff\x00not protobuf") == []
    assert len({run_key_of(line) for line in decoded}) == 1


def test_run_stage_with_state_pickled_per_event_equals_one_pipeline() -> None:
    """State serialized and restored after every event (the worst a checkpoint/restore can do)."""
    stage = RunStage(OVERRIDES)
    reference = Pipeline(SETTINGS)
    state: Optional[PipelineBox] = None
    incidents: Dict[str, dict] = {}
    for line in lines_of("dist_rank_lost"):
        reference.process([json.loads(line)])
        state, out, last = stage.on_event(pickle.loads(pickle.dumps(state)) if state else None, line)
        assert last > 0
        for record in (json.loads(x) for x in out):
            if record["kind"] == "incident":
                incidents[record["record"]["incident_id"]] = record["record"]
    settle = max(json.loads(line).get("time_unix_nano", 0) for line in lines_of("dist_rank_lost")) + 60 * 10**9
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
        state: Optional[PipelineBox] = None
        for line in lines_of("crash"):
            event = json.loads(line)
            event["run_id"] = run
            for _ in range(2):  # every event delivered twice: the replay must not count again
                state, out, _last = stage.on_event(state, json.dumps(event))
                observations += [x for x in out if is_observation(x)]
    assert len(observations) == 2  # one exception per run, its redelivery ignored
    assert len({observation_key(x) for x in observations}) == 1
    cluster_state: Optional[str] = None
    for observation in observations:
        cluster_state, out = clusters.on_observation(cluster_state, observation)
    record = json.loads(out[0])["record"]
    assert record["count"] == 2 and sorted(record["runs"]) == ["a", "b"]
