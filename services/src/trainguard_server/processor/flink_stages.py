"""The two keyed stages of the Flink runtime as plain functions of (state, input) → (state, outputs), so the
PyFlink glue (``flink_job.py``) stays thin and this logic is tested and type-checked without Flink.

Between the stages records are **bytes**, not Python objects or JSON:

* input: the queue's record values, serialized ``trainguard.v1.IngestRequest`` batches (what the gateway
  publishes to Kafka, one run per record); :func:`decode_record` reads only each envelope's project and run
  id and returns ``(run key, bytes of that run's envelopes)`` -- the record's own bytes when it holds one
  run, as it normally does. A record is one element: the Python worker's per-element cost is paid once per
  batch of envelopes, not per envelope.
* stage 1, **per run** (:class:`RunStage`, keyed by project + run id): the pure
  :class:`~trainguard_engine.pipeline.Pipeline` holding that one run. A record's bytes are kept in the
  run's state (:class:`PipelineBox` ``pending``) and folded into the pipeline together, in arrival order,
  once ``flush_events`` envelopes wait (:data:`FLUSH_EVENTS`), at the run's processing-time tick and
  before its settle timer -- one decode (processor/decode.py, as the embedded processor decodes) and one
  ``process`` call per batch instead of per record, as the embedded processor calls it per round. The
  output of a flush is every run and incident record that changed (``{"kind": "run"|"incident",
  "record": ...}``; a run's record once per flush, not once per record) and, for an exception the run
  counted (not a replayed duplicate), an observation for stage 2 (``{"kind": "observation", "key":
  <cluster key>, "event": ...}``; exceptions are folded alone, so that a counted one is known). Pending
  bytes are part of the keyed state, so a checkpoint holds them: nothing is lost between a record's
  arrival and its flush. The state is a :class:`PipelineBox`: the live pipeline, serialized only when the
  engine serializes state (at the end of a bundle, for a checkpoint).
  :meth:`RunStage.on_timer` is the pipeline's ``advance`` (stalls, silent and lagging ranks, lost runs).
* stage 2, **per stack fingerprint** (:class:`ClusterStage`, keyed by project + fingerprint): the cluster
  across runs and ranks, counted exactly as the embedded pipeline counts it
  (:func:`trainguard_engine.clusters.observe`); emits ``{"kind": "cluster", "record": ...}``.

The records are upserts: a later record with the same id (incident id, run, cluster key) replaces an
earlier one. A cluster's ``runs``/``ranks``/``hosts`` lists keep arrival order, which across runs depends on
how the engine interleaves them; compared as sets they are the embedded runtime's.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from trainguard.v1 import ingest_pb2
from trainguard_engine import clusters as clusters_mod
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.extract import as_int, as_str
from trainguard_engine.pipeline import Pipeline, PipelineOutput
from trainguard_engine.state import ClusterState, run_key

from .decode import Points, decode_request

Line = str
Keyed = Tuple[str, bytes]
"""A stage-1 input: the run key and the serialized IngestRequest of that run's envelopes."""

FLUSH_EVENTS = 1024
"""Envelopes a run's state holds before they are folded into its pipeline in one call (also flushed at
the run's tick and before its settle time): per-call costs of the pipeline (its output records, a run's
record per call) paid once per this many envelopes instead of per record (~2 envelopes for the SDK)."""


def decode_record(value: Union[bytes, str]) -> List[Keyed]:
    """The stage-1 inputs of one queue record: ``(run key, bytes)`` per run in it, in first-seen order,
    each run's envelopes in record order (the gateway publishes one run per record: then the record's own
    bytes). [] for a value that is not an IngestRequest (the Kafka queue dead-letters those before any
    runtime sees them) or holds no envelope. A ``str`` value is the record's bytes in base64 (how a
    bounded source hands binary values to PyFlink)."""
    try:
        raw = base64.b64decode(value) if isinstance(value, str) else bytes(value)
        request = ingest_pb2.IngestRequest.FromString(raw)
    except Exception:
        return []
    groups: Dict[str, List[Any]] = {}
    for ev in request.events:
        groups.setdefault(run_key(ev.project, ev.run_id), []).append(ev)
    if len(groups) == 1:
        return [(next(iter(groups)), raw)]
    return [(key, ingest_pb2.IngestRequest(events=events).SerializeToString())
            for key, events in groups.items()]


def run_key_of(item: Keyed) -> str:
    """The stage-1 key of an input: its run's project and run id."""
    return item[0]


def events_of(payload: bytes) -> List[Dict[str, Any]]:
    """The envelopes of a stage-1 input's bytes, in record order."""
    return decode_request(payload)[0]


def _lines(out: PipelineOutput) -> List[Line]:
    lines = [json.dumps({"kind": "run", "record": r.to_dict()}, sort_keys=True) for r in out.runs]
    lines += [json.dumps({"kind": "incident", "record": i.to_dict()}, sort_keys=True) for i in out.incidents]
    return lines


class PipelineBox:
    """A run's stage-1 state: its pipeline, the records not yet folded into it (``pending``, bytes), and
    the runtime's timer bookkeeping (``due_ms``: the run's settle time as of the last flush, its last
    event + settle; ``timer_ms``/``tick_ms``: the event-time and processing-time timers registered, 0:
    none). Between records it stays a live object (the engine's state cache hands the same object back);
    only when the engine serializes state -- at the end of a bundle, for a checkpoint -- is it pickled:
    the pipeline as its snapshot parts (``Pipeline.changed_parts``: the box keeps every part's latest
    bytes in ``parts`` and merges in only what changed since the last pickling, so a run re-encodes only
    the ranks touched since then -- a 4,096-rank run no longer encodes every rank at every bundle), the
    pending records as their bytes. Pickling marks the pipeline's parts saved: every pickling of a box
    must go through :meth:`__getstate__` (the runtime's does)."""

    def __init__(self, pipeline: Pipeline, overrides: str) -> None:
        self.pipeline = pipeline
        self.overrides = overrides
        self.parts: Dict[str, bytes] = {}  # the pipeline's parts as of the last pickling
        self.pending: List[bytes] = []
        self.pending_events = 0
        self.due_ms = 0
        self.timer_ms = 0
        self.tick_ms = 0

    def __getstate__(self) -> Dict[str, Any]:
        for name, blob in self.pipeline.changed_parts().items():
            if blob is None:
                self.parts.pop(name, None)
            else:
                self.parts[name] = bytes(blob)  # a RunPart's rank offsets stay out of the state
        self.pipeline.parts_saved()
        return {"parts": dict(self.parts), "overrides": self.overrides, "pending": self.pending,
                "pending_events": self.pending_events, "due_ms": self.due_ms, "timer_ms": self.timer_ms,
                "tick_ms": self.tick_ms}

    def __setstate__(self, data: Dict[str, Any]) -> None:
        self.overrides = str(data["overrides"])
        settings = DetectionSettings.from_overrides(json.loads(self.overrides))
        self.parts = dict(data["parts"])
        self.pipeline = Pipeline.restore_parts(self.parts, settings)
        self.pending = list(data.get("pending", []))
        self.pending_events = int(data.get("pending_events", 0))
        self.due_ms = int(data.get("due_ms", 0))
        self.timer_ms = int(data.get("timer_ms", 0))
        self.tick_ms = int(data.get("tick_ms", 0))


class Flushed:
    """What a flush or a timer emits: result ``lines`` for the sink, ``observations`` for stage 2."""

    __slots__ = ("lines", "observations")

    def __init__(self) -> None:
        self.lines: List[Line] = []
        self.observations: List[Line] = []


class RunStage:
    """Stage 1: one run's pipeline (see the module doc). ``overrides``: detection setting overrides, JSON;
    ``settle_ms``: the run's settle time after its last event; ``flush_events``: see :data:`FLUSH_EVENTS`."""

    def __init__(self, overrides: str = "{}", settle_ms: int = 0, flush_events: int = FLUSH_EVENTS) -> None:
        self.overrides = overrides
        self.settings = DetectionSettings.from_overrides(json.loads(overrides))
        self.settle_ms = settle_ms
        self.flush_events = max(1, flush_events)

    def box(self, state: Optional[PipelineBox]) -> PipelineBox:
        """``state``, or a new run's."""
        return state if state is not None else PipelineBox(Pipeline(self.settings), self.overrides)

    def on_record(self, box: PipelineBox, payload: bytes) -> Tuple[Flushed, int]:
        """Take one input's bytes into the run; (what a flush emitted -- one happens when
        ``flush_events`` envelopes wait --, the latest event time of the record in ms, 0 if none)."""
        request = ingest_pb2.IngestRequest.FromString(payload)
        latest = max((ev.time_unix_nano for ev in request.events), default=0) // 1_000_000
        box.pending.append(payload)
        box.pending_events += len(request.events)
        if box.pending_events >= self.flush_events:
            return self.flush(box), latest
        return Flushed(), latest

    def flush(self, box: PipelineBox) -> Flushed:
        """Fold the pending records into the pipeline, in order (each exception alone: one the run counted,
        not a replayed duplicate, becomes an observation); what changed."""
        out = Flushed()
        if not box.pending:
            return out
        pending, box.pending, box.pending_events = box.pending, [], 0
        pipeline = box.pipeline
        events: List[Dict[str, Any]] = []
        points: List[Points] = []
        for payload in pending:
            got, pts = decode_request(payload)
            events += got
            points += pts
        start = 0
        for i, event in enumerate(events):
            if not isinstance(event.get("exception"), Mapping):
                continue
            if i > start:
                out.lines += _lines(pipeline.process(events[start:i], points[start:i]))
            start = i + 1
            result = pipeline.process([event], [points[i]])
            out.lines += _lines(result)
            if result.clusters:  # counted: not a duplicate
                fingerprint = clusters_mod.identify(event["exception"])[0]
                key = clusters_mod.cluster_key(as_str(event.get("project")), fingerprint)
                out.observations.append(json.dumps({"kind": "observation", "key": key, "event": event}))
        if start < len(events):
            out.lines += _lines(pipeline.process(events[start:], points[start:]))
        first = events[0] if events else {}
        run = pipeline.run_state(as_str(first.get("project")), as_str(first.get("run_id")))
        if run is not None and run.last_event_ns:
            box.due_ms = max(box.due_ms, run.last_event_ns // 1_000_000 + self.settle_ms)
        return out

    def on_timer(self, box: PipelineBox, now_ns: int) -> Flushed:
        """The pending records folded in, then the pipeline's processing-time decisions at ``now_ns``."""
        out = self.flush(box)
        out.lines += _lines(box.pipeline.advance(now_ns))
        return out


class ClusterStage:
    """Stage 2: one stack-fingerprint cluster across runs (see the module doc)."""

    def __init__(self, overrides: str = "{}") -> None:
        self.settings = DetectionSettings.from_overrides(json.loads(overrides))

    def on_observation(self, state: Optional[str], line: Line) -> Tuple[str, List[Line]]:
        """Count one observation (from :meth:`RunStage.flush`); (new state, output lines)."""
        observation = json.loads(line)
        event: Dict[str, Any] = observation["event"]
        clusters: Dict[str, ClusterState] = {}
        if state:
            restored = ClusterState.from_json(json.loads(state))
            clusters[observation["key"]] = restored
        cluster, _evicted = clusters_mod.observe(
            clusters, as_str(event.get("project")), as_str(event.get("run_id")), as_int(event.get("rank"), 0),
            as_str(event.get("host")), as_str(event.get("event_id")), as_int(event.get("time_unix_nano"), 0),
            event["exception"], self.settings)
        record = json.dumps({"kind": "cluster", "record": cluster.record.to_dict()}, sort_keys=True)
        return json.dumps(cluster.to_json()), [record]


def observation_key(line: Line) -> str:
    """The stage-2 key of an observation line."""
    return str(json.loads(line)["key"])
