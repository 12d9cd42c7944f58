"""api/resolutions.py over a real SQLite incident store holding the pipeline's records of recorded streams:
a page of runs or incidents is shown with one workflow read for the whole page (get_workflows), never one
per incident, and a page of runs with one read of its incidents' briefs (incident_briefs), never one listing
per run -- and shows what a person resolved: counts, health and a stalled run's status."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tests.engine.test_pipeline_golden import streams
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident, RunRecord
from trainguard_server.api import resolutions
from trainguard_server.storage.base import IncidentBrief, IncidentWorkflow, Page
from trainguard_server.storage.sqlite import SqliteIncidentStore

STREAMS = ("fixture/diverging", "fixture/crashing", "corpus/stall", "corpus/dist_nan_one_rank")
COPIES = 6
PROJECT = "p"


class CountingIncidents(SqliteIncidentStore):
    """The real SQLite incident store, counting its workflow reads."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.single: List[str] = []
        self.batches: List[int] = []
        self.listings = 0  # list_incidents calls
        self.brief_reads = 0

    def get_workflow(self, project: str, incident_id: str) -> IncidentWorkflow | None:
        self.single.append(incident_id)
        return super().get_workflow(project, incident_id)

    def list_incidents(self, *args: Any, **kwargs: Any) -> Page[Incident]:
        self.listings += 1
        return super().list_incidents(*args, **kwargs)

    def incident_briefs(self, *args: Any, **kwargs: Any) -> Dict[str, Optional[List[IncidentBrief]]]:
        self.brief_reads += 1
        return super().incident_briefs(*args, **kwargs)

    def get_workflows(self, project: str, incident_ids: Sequence[str]) -> Dict[str, IncidentWorkflow]:
        self.batches.append(len(incident_ids))
        return super().get_workflows(project, incident_ids)


def _fill(store: SqliteIncidentStore) -> List[RunRecord]:
    """The pipeline's last run and incident records of each stream, stored ``COPIES`` times (one run each)
    in one project (an API page is one project's)."""
    for name in STREAMS:
        events, settings = streams()[name]
        out = Pipeline(settings).process(events())
        runs = {r.run_id: r for r in out.runs}
        incidents = {i.incident_id: i for i in out.incidents}
        for copy_no in range(COPIES):
            suffix = f"-{copy_no}"
            store.upsert_runs([_renamed(r, r.run_id + suffix) for r in runs.values()])
            store.upsert_incidents([_renamed(i, i.run_id + suffix, i.incident_id + suffix)
                                    for i in incidents.values()])
    return store.list_runs(PROJECT, limit=1000).items


def _renamed(record, run_id: str, incident_id: str = ""):  # type: ignore[no-untyped-def]
    twin = copy.deepcopy(record)
    twin.project, twin.run_id = PROJECT, run_id
    if incident_id:
        twin.incident_id = incident_id
    return twin


def test_a_page_of_runs_reads_workflows_once_and_shows_what_people_resolved(tmp_path: Path) -> None:
    store = CountingIncidents(tmp_path / "incidents.db")
    try:
        runs = _fill(store)
        with_open = [r for r in runs if r.open_incidents > 0]
        assert len(with_open) >= 3 * COPIES, [(r.run_id, r.open_incidents) for r in runs]
        store.listings = 0
        shown = resolutions.runs(store, runs)
        assert shown == runs  # nobody resolved anything: the processor's records stand
        assert store.single == [] and len(store.batches) == 1  # one workflow read for the page
        assert store.listings == 0 and store.brief_reads == 1  # one incident read for the page

        # a person resolves every open incident of the even copies, and the first open one of copy 1
        resolved: Dict[str, Incident] = {}
        for r in with_open:
            opened = [i for i in store.list_incidents(r.project, run_id=r.run_id, limit=500).items
                      if i.status in resolutions.OPEN_STATUSES]
            assert len(opened) == r.open_incidents
            copy_no = int(r.run_id.rsplit("-", 1)[1])
            chosen = opened if copy_no % 2 == 0 else opened[:1] if copy_no == 1 else []
            for i in chosen:
                store.save_workflow(IncidentWorkflow(project=i.project, incident_id=i.incident_id,
                                                     run_id=i.run_id, resolved_by="ana", resolved_ns=123,
                                                     root_cause="fixed"))
                resolved[i.incident_id] = i
        store.single.clear()
        store.batches.clear()
        store.listings = store.brief_reads = 0
        shown = resolutions.runs(store, runs)
        assert store.single == [] and len(store.batches) == 1
        assert store.listings == 0 and store.brief_reads == 1
        for before, after in zip(runs, shown):
            if before.open_incidents <= 0:
                assert after is before
                continue
            copy_no = int(before.run_id.rsplit("-", 1)[1])
            if copy_no % 2 == 0:
                assert (after.open_incidents, after.health) == (0, "healthy")
                assert after.status == ("running" if before.status == "stalled" else before.status)
            elif copy_no == 1:
                assert after.open_incidents == before.open_incidents - 1
            else:
                assert after is before
            assert resolutions.run(store, before) == after  # one run alone shows the same

        # a page of incidents: one read, the resolved ones shown resolved with the person's time
        page = store.list_incidents(PROJECT, limit=500).items
        assert len(page) > len(resolved) > 0
        store.batches.clear()
        shown_incidents = resolutions.incidents(store, page)
        assert store.single == [] and len(store.batches) == 1
        for before, after in zip(page, shown_incidents):
            if before.incident_id in resolved:
                assert (after.status, after.resolved_ns) == ("resolved", before.resolved_ns or 123)
            else:
                assert after is before
        assert [i.incident_id for i in resolutions.incidents(store, page, status="resolved")] == [
            i.incident_id for i in page if i.incident_id in resolved or i.status == "resolved"]
    finally:
        store.close()
