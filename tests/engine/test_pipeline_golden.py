"""Golden digests of the pipeline's outputs on every recorded stream (issue 15's safety net).

For each recorded run -- the scenario corpus (CPU trainings, H200 recordings, gloo jobs), the demo
fixture streams and the two-H200 NCCL jobs as TrainGuard receives them (SDK streams + rank logs + exit
codes) -- the run's events go through the pure pipeline, then ``advance`` a minute after the last event;
the digest is a SHA-256 of the canonical JSON of every run, incident and cluster record the store would
hold (the last upsert of each, in key order). ``golden/pipeline_digests.json`` holds the digests recorded
before the engine was restructured, next to each run's incident kinds for a readable diff. A refactor
must keep every digest; a *deliberate* detection change regenerates the file (and says so in its commit):

    .venv/bin/python -m tests.engine.test_pipeline_golden --update

Each stream is processed twice -- in records of 50 envelopes (what the gateway publishes) and in one
call -- and both must give the same records: how a runtime batches events is not a detection input.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import pytest

from tests.engine.test_pipeline import DEMO, NAMES, load
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.extract import metric_points
from trainguard_engine.pipeline import Pipeline, PipelineOutput

GOLDEN = Path(__file__).resolve().parent / "golden" / "pipeline_digests.json"
CORPUS = DetectionSettings.from_overrides({"stall_min_s": 5.0})  # the corpus's stall floor
SETTLE_NS = 60 * 10**9
RECORD = 50

Event = Dict[str, Any]


def _nccl_job(name: str) -> List[Event]:
    from tests.services.replay.test_nccl_jobs import folder
    from tests.support.recorded_jobs import agent_view

    with tempfile.TemporaryDirectory() as tmp:
        return agent_view(folder(name), Path(tmp))


def _nccl_names() -> List[str]:
    from tests.services.replay.test_nccl_jobs import EXPECTED

    return sorted(EXPECTED)


def streams() -> Dict[str, Tuple[Callable[[], List[Event]], DetectionSettings]]:
    """Every recorded stream by a stable name, with the settings it is judged under."""
    out: Dict[str, Tuple[Callable[[], List[Event]], DetectionSettings]] = {}
    for s in SCENARIOS:
        out[f"corpus/{s.name}"] = (s.events, CORPUS)
    for name in NAMES:
        out[f"fixture/{name}"] = ((lambda n=name: load(n)), DEMO)  # type: ignore[misc]
    for name in _nccl_names():
        out[f"nccl/{name}"] = ((lambda n=name: _nccl_job(n)), CORPUS)  # type: ignore[misc]
    return out


def _store(outputs: Sequence[PipelineOutput]) -> Dict[str, Dict[str, Any]]:
    """What an upserting store holds after ``outputs``, in key order, as plain dicts."""
    held: Dict[str, Dict[str, Any]] = {}
    for out in outputs:
        for r in out.runs:
            held[f"run/{r.project}/{r.run_id}"] = r.to_dict()
        for i in out.incidents:
            held[f"incident/{i.project}/{i.incident_id}"] = i.to_dict()
        for c in out.clusters:
            held[f"cluster/{c.project}/{c.fingerprint}"] = c.to_dict()
    return dict(sorted(held.items()))


def run_stream(events: Sequence[Event], settings: DetectionSettings, record: int,
               points_given: bool = False) -> Dict[str, Any]:
    """The store after the stream, fed ``record`` envelopes per call (0: one call), then settled;
    ``points_given``: with each envelope's metric points read beforehand, as the embedded processor
    passes them."""
    pipeline = Pipeline(settings)
    step = record or max(1, len(events))
    outputs = [pipeline.process(events[i:i + step],
                                [metric_points(e) if "metrics" in e else None for e in events[i:i + step]]
                                if points_given else None)
               for i in range(0, len(events), step)]
    last = max(int(e.get("time_unix_nano") or 0) for e in events)
    outputs.append(pipeline.advance(last + SETTLE_NS))
    return _store(outputs)


def digest(held: Dict[str, Any]) -> str:
    blob = json.dumps(held, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def kinds(held: Dict[str, Any]) -> List[str]:
    return sorted(f"{v['category']}/{v['subtype']}" for k, v in held.items() if k.startswith("incident/"))


@cache
def golden() -> Dict[str, Any]:
    data: Dict[str, Any] = json.loads(GOLDEN.read_text())
    return data


STREAMS = streams()


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_outputs_equal_the_golden_digest(name: str) -> None:
    load_events, settings = STREAMS[name]
    events = load_events()
    in_records = run_stream(events, settings, RECORD)
    want = golden()[name]
    assert kinds(in_records) == want["kinds"]
    assert digest(in_records) == want["digest"], f"{name}: the pipeline's records changed"
    assert run_stream(events, settings, 0) == in_records  # batching is not an input
    assert run_stream(events, settings, RECORD, points_given=True) == in_records  # nor who read the points


def test_every_stream_has_a_golden_digest() -> None:
    assert sorted(golden()) == sorted(STREAMS)


def update() -> None:
    """Rewrite the golden file from the current code."""
    doc: Dict[str, Any] = {}
    for name in sorted(STREAMS):
        load_events, settings = STREAMS[name]
        held = run_stream(load_events(), settings, RECORD)
        doc[name] = {"digest": digest(held), "kinds": kinds(held), "records": len(held)}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(doc)} digests to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python -m tests.engine.test_pipeline_golden --update")
    update()
