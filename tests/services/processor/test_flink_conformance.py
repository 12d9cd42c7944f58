"""Conformance: the Flink runtime and the embedded runtime make the same incidents, runs and clusters of
the same recorded streams (issue 5).

The Flink side is the real job graph (``trainguard_server.processor.flink_job.build_job``) on a real local
Flink mini-cluster (``apache-flink`` 2.3.0 in ``.venv-flink``, the machine's Java 17), parallelism 2,
checkpointing on, fed from a bounded source of queue record values (serialized IngestRequest batches, as
the gateway publishes them) and writing to a ``FileSink``. The embedded side is the same pure pipeline
driven as the embedded processor drives it: every event in record order, then ``advance`` at the settle
time. Input: every run of the scenario corpus (CPU trainings, H200 recordings, two-process gloo jobs) and
the two-H200 NCCL jobs as TrainGuard receives them (SDK + logs + exit codes), each twice under two run ids
so stack-fingerprint clusters span runs. Every run is retimed to end at the same instant, so the Flink job's
per-run event-time timers (last event + settle) and the embedded runtime's one ``advance`` decide at the
same time. One Flink job (a job start costs ~10 s here).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS, retimed
from tests.services.replay.test_nccl_jobs import EXPECTED as NCCL_JOBS
from tests.services.replay.test_nccl_jobs import folder as nccl_folder
from tests.support.recorded_jobs import agent_view
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_server.processor.flink_main import write_records

REPO = Path(__file__).resolve().parents[3]
FLINK_PYTHON = Path(os.environ.get("TRAINGUARD_FLINK_PYTHON", REPO / ".venv-flink" / "bin" / "python"))
END_NS = 1_800_000_000_000_000_000
SETTLE_S = 60.0
OVERRIDES = {"stall_min_s": 5.0}  # the corpus's stall floor (tests/engine/test_comm_scenarios.py)
BATCH = 50
COPIES = 2

Event = Dict[str, Any]


def corpus(tmp_path: Path) -> List[List[Event]]:
    """Every run's events, retimed to end at END_NS, each run twice (run ids and event ids renamed)."""
    runs: List[List[Event]] = [s.events() for s in SCENARIOS]
    runs += [agent_view(nccl_folder(name), tmp_path) for name in NCCL_JOBS]
    out: List[List[Event]] = []
    for copy in range(COPIES):
        for events in runs:
            moved = retimed(events, END_NS)
            for e in moved:
                e["run_id"] = f"{e['run_id']}~{copy}"
                e["event_id"] = f"{e.get('event_id') or ''}~{copy}"
            out.append(moved)
    return out


def records(runs: List[List[Event]]) -> List[bytes]:
    return [wire.ingest_request_from_dicts(events[i:i + BATCH]).SerializeToString()
            for events in runs for i in range(0, len(events), BATCH)]


def embedded(runs: List[List[Event]]) -> Pipeline:
    pipeline = Pipeline(DetectionSettings.from_overrides(OVERRIDES))
    for value in records(runs):  # what the embedded processor consumes, decoded as it decodes them
        from trainguard.v1 import ingest_pb2
        pipeline.process([wire.envelope_to_dict(ev) for ev in ingest_pb2.IngestRequest.FromString(value).events])
    pipeline.advance(END_NS + int(SETTLE_S * 1e9))
    return pipeline


def flink(runs: List[List[Event]], tmp_path: Path) -> Tuple[List[Dict[str, Any]], float]:
    """The job's output records (in emission order per key) and its wall time."""
    source = tmp_path / "records.bin"
    write_records(source, records(runs))
    out = tmp_path / "flink-out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"), str(REPO / "services" / "src")]))
    started = time.monotonic()
    proc = subprocess.run([str(FLINK_PYTHON), "-m", "trainguard_server.processor.flink_main", "--records",
                           str(source), "--out", str(out), "--parallelism", "2", "--settle-s", str(SETTLE_S),
                           "--overrides", json.dumps(OVERRIDES)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines: List[Dict[str, Any]] = []
    parts = parts_in_order(out)
    assert parts and not any(p.name.startswith(".") for p in parts), parts  # every part file committed
    for part in parts:
        with open(part, encoding="utf-8") as fh:
            lines += [json.loads(line) for line in fh if line.strip()]
    return lines, took


def parts_in_order(out: Path) -> List[Path]:
    """The FileSink's part files in the order each subtask wrote them: ``part-<subtask's uuid>-<n>.jsonl``
    by n as a number (by name, part 10 would come before part 2 and an older upsert of a run would read as
    its latest). A run's and a cluster's records all come from one subtask: their order is what counts."""
    def order(path: Path) -> Tuple[str, str, int]:
        prefix, _, n = path.name.split(".")[0].rpartition("-")
        return str(path.parent), prefix, int(n) if n.isdigit() else -1
    return sorted((p for p in out.rglob("*") if p.is_file()), key=order)


def latest(lines: List[Dict[str, Any]], kind: str, key: str) -> Dict[str, Dict[str, Any]]:
    found: Dict[str, Dict[str, Any]] = {}
    for line in lines:
        if line["kind"] == kind:
            record = line["record"]
            found[record[key] if isinstance(key, str) and key in record else json.dumps(
                [record.get("project"), record.get("run_id")])] = record
    return found


def as_sets(cluster: Dict[str, Any]) -> Dict[str, Any]:
    return {k: sorted(v) if k in ("runs", "ranks", "hosts") else v for k, v in cluster.items()}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Pipeline, List[Dict[str, Any]], float]:
    tmp = tmp_path_factory.mktemp("flink")
    runs = corpus(tmp)
    lines, took = flink(runs, tmp)
    print(f"flink job: {sum(len(r) for r in runs)} events of {len(runs)} runs in {took:.1f} s")
    return embedded(runs), lines, took


def test_incidents_are_identical(both: Tuple[Pipeline, List[Dict[str, Any]], float]) -> None:
    pipeline, lines, _ = both
    expected = {i.incident_id: i.to_dict() for i in pipeline.incidents()}
    got = latest(lines, "incident", "incident_id")
    assert len(expected) >= 2 * 26  # every anomalous run, both copies (and their folded consequences)
    assert sorted(got) == sorted(expected)
    for incident_id, record in expected.items():
        assert got[incident_id] == record, incident_id


def test_runs_are_identical(both: Tuple[Pipeline, List[Dict[str, Any]], float]) -> None:
    pipeline, lines, _ = both
    expected = {json.dumps([r.project, r.run_id]): r.to_dict() for r in pipeline.runs()}
    got = latest(lines, "run", "")
    assert sorted(got) == sorted(expected)
    for key, record in expected.items():
        assert got[key] == record, key


def test_clusters_are_identical_across_runs(both: Tuple[Pipeline, List[Dict[str, Any]], float]) -> None:
    pipeline, lines, _ = both
    expected = {c.fingerprint: as_sets(c.to_dict()) for c in pipeline.clusters()}
    got = {fp: as_sets(c) for fp, c in latest(lines, "cluster", "fingerprint").items()}
    assert expected and sorted(got) == sorted(expected)
    for fingerprint, record in expected.items():
        assert got[fingerprint] == record, fingerprint
    assert all(len(c["runs"]) >= COPIES for c in expected.values())  # each spans both copies of its run
