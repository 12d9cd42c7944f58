"""Issue 18, finding 2: one project must not evict another's live runs.

``max_runs`` (10,000) was global: 10,000 one-event runs of project B evicted project A's live run, whose later
NaN then raised nothing. Now every bound is also a per-project quota (runs, clusters, incidents, state
bytes); a project beyond its quota -- or holding the most when the pipeline is full -- loses its own runs,
never another project's, and each such eviction is counted per (project, quota)."""

from __future__ import annotations

from typing import Any, Dict, List

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

T0 = 1_700_000_000 * 10**9
Event = Dict[str, Any]


def metric(project: str, run: str, step: int, loss: Any, t: int) -> Event:
    return {"event_id": f"{project}/{run}/{step}", "project": project, "run_id": run, "step": step,
            "time_unix_nano": t, "metrics": {"points": [{"name": "loss", "value": loss}]}}


def crash(project: str, run: str, t: int, where: str) -> Event:
    """An uncaught exception whose stack (and so fingerprint) is ``where``'s."""
    return {"event_id": f"{project}/{run}/exc/{where}", "project": project, "run_id": run, "step": 1,
            "time_unix_nano": t, "exception": {
                "type": "ValueError", "message": f"bad value in {where}", "handled": False,
                "frames": [{"filename": f"/job/{where}.py", "function": where, "lineno": 3, "in_app": True}]}}


def live_run(project: str = "A", run: str = "live", steps: int = 20) -> List[Event]:
    return [metric(project, run, s, 2.0 / (1 + s), T0 + s * 10**9) for s in range(steps)]


def flood(project: str, runs: int, t: int) -> List[Event]:
    """``runs`` one-event runs of ``project``, all newer than the live run's events."""
    return [metric(project, f"tiny-{i}", 0, 1.0, t + i) for i in range(runs)]


def test_another_projects_10000_tiny_runs_do_not_evict_a_live_run() -> None:
    pipeline = Pipeline()  # the defaults: max_runs 10,000
    pipeline.process(live_run())
    pipeline.process(flood("B", 10_000, T0 + 30 * 10**9))
    assert pipeline.run_state("A", "live") is not None  # evicted before the fix
    out = pipeline.process([metric("A", "live", 20, "NaN", T0 + 40 * 10**9)])
    assert [(i.run_id, i.subtype) for i in out.incidents] == [("live", "non_finite")]  # raised nothing before
    assert pipeline.quota_evictions == {("B", "runs"): 1}  # the pipeline was full: the largest project paid
    assert pipeline.counters["runs_evicted"] == 1 and pipeline.counters["late"] == 0


def test_a_project_over_its_own_quota_loses_only_its_own_runs() -> None:
    settings = DetectionSettings(project_max_runs=100)
    pipeline = Pipeline(settings)
    pipeline.process(live_run("A", "live") + live_run("A", "other"))
    pipeline.process(flood("B", 300, T0 + 30 * 10**9))
    assert sorted(r.run_id for r in pipeline.runs() if r.project == "A") == ["live", "other"]
    kept = sorted(int(r.run_id.split("-")[1]) for r in pipeline.runs() if r.project == "B")
    assert kept == list(range(200, 300))  # its least recently active went first
    assert pipeline.quota_evictions == {("B", "runs"): 200}


def test_a_projects_ended_runs_go_before_its_live_ones() -> None:
    pipeline = Pipeline(DetectionSettings(project_max_runs=3))
    ended = [*live_run("A", "ended", 3), {"event_id": "A/ended/exit", "project": "A", "run_id": "ended",
                                          "step": 3, "time_unix_nano": T0 + 50 * 10**9,
                                          "lifecycle": {"phase": "EXIT", "exit_code": 0}}]
    pipeline.process(live_run("A", "first", 3) + live_run("A", "second", 3) + ended)
    pipeline.process(live_run("A", "third", 3))
    assert sorted(r.run_id for r in pipeline.runs()) == ["first", "second", "third"]


def test_clusters_are_evicted_within_the_project_over_its_quota() -> None:
    pipeline = Pipeline(DetectionSettings(project_max_clusters=10))
    pipeline.process([crash("A", "a", T0, "loader")])
    pipeline.process([crash("B", f"b{i}", T0 + 1 + i, f"where{i}") for i in range(50)])
    by_project: Dict[str, int] = {}
    for c in pipeline.clusters():
        by_project[c.project] = by_project.get(c.project, 0) + 1
    assert by_project == {"A": 1, "B": 10}
    assert pipeline.quota_evictions[("B", "clusters")] == 40


def test_incidents_beyond_the_projects_quota_evict_its_older_runs_not_anothers() -> None:
    pipeline = Pipeline(DetectionSettings(project_max_incidents=5))
    nan_a = [*live_run("A", "a", 5), metric("A", "a", 5, "NaN", T0 + 5 * 10**9)]
    pipeline.process(nan_a)
    for i in range(12):
        t = T0 + (100 + 10 * i) * 10**9
        pipeline.process([metric("B", f"b{i}", s, 1.0 if s < 5 else "NaN", t + s) for s in range(6)])
    held = [(i.project, i.run_id) for i in pipeline.incidents()]
    assert ("A", "a") in held
    assert len([p for p, _r in held if p == "B"]) == 5
    assert pipeline.quota_evictions[("B", "incidents")] == 7


def test_state_bytes_beyond_the_quota_evict_within_the_project_at_the_next_tick() -> None:
    pipeline = Pipeline(DetectionSettings(project_max_state_bytes=20_000))
    pipeline.process(live_run("A", "a", 30))
    pipeline.process([e for i in range(40) for e in live_run("B", f"b{i}", 10)])
    parts = pipeline.changed_parts()  # the sizes are measured here
    pipeline.parts_saved()
    b_bytes = sum(len(v) for k, v in parts.items() if k.startswith("run/B") and v)
    assert b_bytes > 20_000
    pipeline.advance(T0 + 60 * 10**9)
    b_runs = [r for r in pipeline.runs() if r.project == "B"]
    assert 0 < len(b_runs) < 40 and pipeline.run_state("A", "a") is not None
    assert pipeline.quota_evictions[("B", "state_bytes")] == 40 - len(b_runs)
    after = pipeline.changed_parts()
    assert sum(1 for k, v in after.items() if k.startswith("run/B") and v is None) == 40 - len(b_runs)


def test_a_restored_pipeline_evicts_as_the_original_would() -> None:
    settings = DetectionSettings(project_max_runs=5)
    first = live_run("B", "x", 3) + live_run("B", "y", 3) + flood("B", 3, T0 + 10 * 10**9)
    then = flood("B", 4, T0 + 20 * 10**9 + 100)
    then = [dict(e, run_id=e["run_id"] + "-later") for e in then]
    straight = Pipeline(settings)
    straight.process(first)
    restored = Pipeline.restore(straight.snapshot(), settings)
    parts = Pipeline.restore_parts({k: v for k, v in straight.changed_parts().items() if v is not None},
                                   settings)
    assert straight.process(then) == restored.process(then) == parts.process(then)
    assert straight.runs() == restored.runs() == parts.runs()
    assert sorted(r.run_id for r in straight.runs()) == sorted(["tiny-2", "tiny-0-later", "tiny-1-later",
                                                                 "tiny-2-later", "tiny-3-later"])
