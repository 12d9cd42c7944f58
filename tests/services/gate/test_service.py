"""gate.service over the real stores (memory and SQLite): baselines defined from a tag or a run list, kept
in the incident store's state (surviving a reopen), scoped by project; the refusals."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from trainguard_engine.records import Incident, RunRecord
from trainguard_server.gate.policy import Policy
from trainguard_server.gate.service import GateError, GateService
from trainguard_server.storage.base import MetricPoint, StoredEvent
from trainguard_server.storage.memory import MemoryEventStore, MemoryIncidentStore, MemoryMetricStore
from trainguard_server.storage.sqlite import open_sqlite_stores


class Stores:
    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path
        self.open()

    def open(self) -> None:
        if self.kind == "memory":
            self.incidents: Any = MemoryIncidentStore()
            self.metrics: Any = MemoryMetricStore()
            self.events: Any = MemoryEventStore()
            self._sqlite = None
        else:
            self._sqlite = open_sqlite_stores(self.path)
            self.incidents, self.metrics = self._sqlite.incidents, self._sqlite.metrics
            self.events = self._sqlite.events

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()

    def service(self, project: str = "alpha") -> GateService:
        return GateService(self.incidents, self.metrics, self.events, project)


def add_run(stores: Stores, project: str, run_id: str, seed: int, *, tag: str = "", status: str = "finished",
            exception: str = "") -> None:
    now = time.time_ns()
    stores.incidents.upsert_runs([RunRecord(project=project, run_id=run_id, status=status, last_step=99,
                                            last_event_ns=now + seed, tags={"gate": tag} if tag else {})])
    points = [MetricPoint(project, run_id, 0, "loss", s, now, 0.5 * math.exp(-s / 30) * (1 + 0.02 * seed))
              for s in range(100)]
    points += [MetricPoint(project, run_id, 0, "mem/rss", s, now, 3e8 + seed) for s in range(0, 100, 10)]
    stores.metrics.put(points)
    if exception:
        stores.events.put([StoredEvent(event_id=f"{run_id}-exc", project=project, run_id=run_id, rank=0, host="h",
                                       kind="exception", severity="ERROR", step=50, time_ns=now, text="boom",
                                       payload={"exception": {"type": "KeyError", "message": exception,
                                                              "handled": True, "frames": [
                                                                  {"filename": "train.py", "module": "train",
                                                                   "function": "step", "lineno": 3,
                                                                   "in_app": True}]}})])


@pytest.fixture(params=["memory", "sqlite"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    s = Stores(request.param, tmp_path / "data")
    for seed in range(3):
        add_run(s, "alpha", f"base-{seed}", seed, tag="base")
    add_run(s, "alpha", "handled", 7, exception="batch 12 has 3 NaN values")
    add_run(s, "beta", "beta-0", 0, tag="base")
    yield s
    s.close()


def test_define_from_a_tag_and_read_it_back(stores: Stores) -> None:
    service = stores.service()
    baseline = service.define("main", Policy(), tag="gate=base", description="d")
    assert sorted(baseline.runs) == ["base-0", "base-1", "base-2"] and baseline.tag == "gate=base"
    again = service.get("main")
    assert again is not None and again.to_dict() == baseline.to_dict()
    profile = again.get_profile()
    assert profile.loss is not None and len(profile.loss.steps) == 100
    assert profile.peak_memory is not None and profile.peak_memory.metric == "mem/rss"
    assert service.names() == ["main"]
    # redefining keeps the creation time and replaces the runs
    redefined = service.define("main", Policy(), runs=["base-0", "base-1"])
    assert redefined.created_ns == baseline.created_ns and redefined.runs == ["base-0", "base-1"]
    assert service.names() == ["main"]
    # another project sees nothing of it
    assert stores.service("beta").get("main") is None and stores.service("beta").names() == []
    assert service.gate("main", "handled", Policy()).verdict == "fail"  # its handled exception is new
    if stores.kind == "sqlite":
        stores.close()
        stores.open()
        assert stores.service().get("main") is not None


def test_a_handled_exception_in_the_baseline_is_a_known_fingerprint(stores: Stores) -> None:
    add_run(stores, "alpha", "also-handled", 8, exception="batch 40 has 9 NaN values")  # same template
    service = stores.service()
    service.define("with-handled", Policy(), runs=["base-0", "base-1", "handled"])
    verdict = service.gate("with-handled", "also-handled", Policy())
    fp = {c.name: c for c in verdict.checks}["fingerprints"]
    assert fp.status == "pass" and fp.figures["candidate"] == 1, fp


@pytest.mark.parametrize("kwargs,message", [
    ({"tag": "gate=nothing"}, "no run of project 'alpha' has the tag 'gate=nothing'"),
    ({"tag": "\u000b"}, "invalid tag filter '\\x0b': use key=value or key"),  # schemathesis, CI of stop 45
    ({"tag": " =base"}, "invalid tag filter ' =base'"),
    ({"runs": ["base-0", "ghost"]}, "unknown run(s) in project 'alpha': ghost"),
    ({"runs": ["beta-0"]}, "unknown run(s) in project 'alpha': beta-0"),
    ({}, "from a tag or from a list of runs"),
    ({"tag": "gate=base", "runs": ["base-0"]}, "from a tag or from a list of runs"),
])
def test_refusals(stores: Stores, kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(GateError) as err:
        stores.service().define("x", Policy(), **kwargs)
    assert message in str(err.value)
    with pytest.raises(GateError, match="a baseline name is"):
        stores.service().define("../etc", Policy(), tag="gate=base")


def test_gate_unknowns_are_undecided(stores: Stores) -> None:
    service = stores.service()
    verdict = service.gate("nope", "base-0", Policy())
    assert verdict.exit_code == 2 and "none defined: define one first" in verdict.reason
    service.define("main", Policy(), tag="gate=base")
    verdict = service.gate("main", "ghost", Policy())
    assert verdict.exit_code == 2 and "no run 'ghost' in project 'alpha'" in verdict.reason
    assert service.gate("nope", "base-0", Policy()).reason.endswith("(defined: main)")


def test_incidents_folded_into_another_are_not_counted(stores: Stores) -> None:
    add_run(stores, "alpha", "folded", 9)
    stores.incidents.upsert_incidents([
        Incident(incident_id="i1", project="alpha", run_id="folded", category="comm", subtype="timeout",
                 severity="critical", explained_by="i0"),
        Incident(incident_id="i2", project="alpha", run_id="folded", category="loss", subtype="oscillation",
                 severity="warning")])
    service = stores.service()
    data = service.reader.run_data("folded", ["loss"])
    assert data is not None and [i.kind for i in data.incidents] == ["loss/oscillation"]


def test_baselines_saved_by_two_api_processes_are_both_listed(tmp_path: Path) -> None:
    """Two processes on one data dir (two handles on its SQLite): neither save hides the other's name."""
    first, second = Stores("sqlite", tmp_path / "data"), Stores("sqlite", tmp_path / "data")
    try:
        for seed in range(3):
            add_run(first, "alpha", f"base-{seed}", seed, tag="base")
        add_run(first, "alpha/x", "nested-0", 0, tag="base")
        first.service().define("one", Policy(), tag="gate=base")
        second.service().define("two", Policy(), tag="gate=base")
        first.service("alpha/x").define("three", Policy(), tag="gate=base")
        assert first.service().names() == second.service().names() == ["one", "two"]
        assert second.service("alpha/x").names() == ["three"]  # a project extending "alpha" stays apart
    finally:
        first.close()
        second.close()


def test_the_cli_waits_for_baseline_runs_still_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The last baseline canary exited a moment ago and the processor has not closed its run yet: the CLI
    waits for it and profiles all three runs (it used to leave the running one out)."""
    from trainguard_server.cli import build_parser

    stores = Stores("sqlite", tmp_path / "data")
    try:
        for seed in range(2):
            add_run(stores, "p", f"base-{seed}", seed, tag="base")
        add_run(stores, "p", "base-2", 2, tag="base", status="running")
        finish = threading.Timer(1.0, lambda: add_run(stores, "p", "base-2", 2, tag="base"))
        finish.start()
        args = build_parser().parse_args(["gate", "--data-dir", str(tmp_path / "data"), "--project", "p",
                                          "--baseline", "main", "--baseline-tag", "gate=base",
                                          "--wait-timeout", "30"])
        assert args.func(args) == 0
        finish.join()
        out = capsys.readouterr().out
        assert "waiting up to 30 s for 1 baseline run(s) still running: base-2" in out
        baseline = stores.service("p").get("main")
        assert baseline is not None
        assert sorted(baseline.profile["runs"]) == ["base-0", "base-1", "base-2"]
    finally:
        stores.close()
