"""security.md H48: one project's flood of run ids must not make the pipeline forget another project's
evicted runs.

The pipeline remembers ``evicted_runs_remembered`` evicted runs, all projects together, so that a late or
redelivered event of an evicted run is dropped (``late``) instead of starting a new, partial record. The
oldest entry used to go whatever its project: project A sending tens of thousands of distinct run ids
(each evicted within A's own ``project_max_runs``) pushed project B's finished run out of that memory, and
B's next redelivered event restarted it -- its record upserted as ``running``, its exception incident
opened again. Now the memory is shared fairly (:class:`trainguard_engine.quotas.EvictedRuns`)."""

from __future__ import annotations

from typing import Any, Dict, List

from tests.engine.test_project_quotas import T0, crash, flood, live_run, metric
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.quotas import EvictedRuns

HOUR = 3600 * 10**9


def finished(project: str, run: str) -> List[Dict[str, Any]]:
    """A run of 20 steps that raised, then exited 1."""
    return [*live_run(project, run), crash(project, run, T0 + 20 * 10**9, "loader"),
            {"event_id": f"{project}/{run}/exit", "project": project, "run_id": run, "step": 20,
             "time_unix_nano": T0 + 21 * 10**9, "lifecycle": {"phase": "EXIT", "exit_code": 1}}]


def b_finished_then_evicted(settings: DetectionSettings) -> Pipeline:
    pipeline = Pipeline(settings)
    out = pipeline.process(finished("B", "done"))
    assert [(i.run_id, i.subtype) for i in out.incidents] == [("done", "exception")]
    pipeline.advance(T0 + 2 * HOUR)  # ended_run_ttl_s (1 h) after its last event
    assert pipeline.run_state("B", "done") is None and pipeline.counters["runs_evicted"] == 1
    return pipeline


def redelivered(pipeline: Pipeline) -> Any:
    """B's exception delivered again (at-least-once) and a late NaN of the same run."""
    return pipeline.process([crash("B", "done", T0 + 20 * 10**9, "loader"),
                             metric("B", "done", 21, "NaN", T0 + 22 * 10**9)])


def test_another_projects_flood_of_run_ids_does_not_forget_b_s_evicted_run() -> None:
    settings = DetectionSettings(project_max_runs=50, evicted_runs_remembered=200)
    pipeline = b_finished_then_evicted(settings)
    pipeline.process(flood("A", 1_000, T0 + 3 * HOUR))  # 950 of A's runs evicted within A's quota
    assert pipeline.counters["runs_evicted"] == 951
    late = pipeline.counters["late"]
    out = redelivered(pipeline)
    assert out.runs == [] and out.incidents == []  # before: B/done again, 'running', and two incidents
    assert pipeline.run_state("B", "done") is None
    assert pipeline.counters["late"] == late + 2


def test_with_the_default_bounds_20000_run_ids_do_not_forget_b_s_evicted_run() -> None:
    pipeline = b_finished_then_evicted(DetectionSettings())  # 10,000 runs per project, 10,000 remembered
    pipeline.process(flood("A", 20_001, T0 + 3 * HOUR))
    assert pipeline.counters["runs_evicted"] == 10_002
    out = redelivered(pipeline)
    assert out.runs == [] and out.incidents == []


def test_a_restored_pipeline_keeps_the_fair_share() -> None:
    settings = DetectionSettings(project_max_runs=50, evicted_runs_remembered=200)
    pipeline = b_finished_then_evicted(settings)
    pipeline.process(flood("A", 300, T0 + 3 * HOUR))
    pipeline = Pipeline.restore(pipeline.snapshot(), settings)
    pipeline.process(flood("A", 1_000, T0 + 4 * HOUR))
    assert redelivered(pipeline).runs == []


def test_the_flooding_project_forgets_its_own_oldest_first() -> None:
    memory = EvictedRuns()
    memory.put("B\x00b0", 1, 6)
    memory.put("C\x00c0", 2, 6)
    for i in range(10):
        memory.put(f"A\x00a{i}", 10 + i, 6)
    assert list(k for k, _ in memory.items()) == ["B\x00b0", "C\x00c0", "A\x00a6", "A\x00a7", "A\x00a8",
                                                  "A\x00a9"]
    memory.put("C\x00c1", 30, 6)  # full: the project holding the most (A) forgets its oldest
    assert "A\x00a6" not in memory and "B\x00b0" in memory and len(memory) == 6
    memory.put("A\x00a6", 31, 6)  # remembered again: A's own oldest goes
    assert "A\x00a7" not in memory and "A\x00a6" in memory and "C\x00c0" in memory


def test_the_order_survives_a_round_trip_through_items() -> None:
    memory = EvictedRuns()
    for i, key in enumerate(["A\x00x", "B\x00y", "A\x00z", "B\x00y"]):
        memory.put(key, i, 10)
    again = EvictedRuns(memory.items())
    assert list(again.items()) == [("A\x00x", 0), ("A\x00z", 2), ("B\x00y", 3)]
    assert again.by_project == {"A": {"A\x00x": None, "A\x00z": None}, "B": {"B\x00y": None}}
