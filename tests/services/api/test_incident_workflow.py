"""Incident workflow through the query API: acknowledge, resolve with a confirmed root cause, notes, the
library of resolved incidents of the same kind -- scoped to the caller's project, with precise 4xx."""

from __future__ import annotations

from typing import Any, Dict, Iterator

import pytest

from tests.services.api.test_query_api import World
from trainguard_server.api.routes.workflow import ranked_causes
from trainguard_server.storage.base import IncidentWorkflow


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    yield World()


def post(world: World, path: str, body: Dict[str, Any], project: str = "alpha", kind: str = "read") -> Any:
    return world.client.post(path, json=body, headers={"Authorization": f"Bearer {world.tokens[project][kind]}"})


def incident_of(world: World, project: str = "alpha") -> Dict[str, Any]:
    items = world.get("/api/v1/incidents", project=project).json()["items"]
    assert items
    return dict(items[0])


def test_acknowledge_note_resolve_and_the_library(world: World) -> None:
    inc = incident_of(world)
    path = f"/api/v1/incidents/{inc['incident_id']}"
    processor_run = world.services.incidents.get_run("alpha", inc["run_id"])  # as the processor wrote it
    assert processor_run is not None and inc["status"] in ("open", "ongoing") and processor_run.open_incidents >= 1
    empty = world.get(f"{path}/workflow").json()
    assert empty["workflow"]["acknowledged_ns"] == 0 and empty["workflow"]["category"] == inc["category"]

    acked = post(world, f"{path}/acknowledge", {"by": "ana"}).json()["workflow"]
    assert acked["acknowledged_by"] == "ana" and acked["acknowledged_ns"] > 0
    again = post(world, f"{path}/acknowledge", {"by": "bo"}).json()["workflow"]
    assert again["acknowledged_by"] == "ana"  # the first one who took it

    noted = post(world, f"{path}/notes", {"by": "ana", "text": "LR warmup ends at step 40"}).json()["workflow"]
    assert [n["text"] for n in noted["notes"]] == ["LR warmup ends at step 40"]

    resolved = post(world, f"{path}/resolve", {"by": "ana", "root_cause": "LR schedule bug: warmup to 10x"})
    assert resolved.status_code == 200
    assert resolved.json()["workflow"]["root_cause"] == "LR schedule bug: warmup to 10x"
    # one status everywhere (issue 22): resolved at once, and still after the processor upserts its own record
    assert world.get(path).json()["status"] == "resolved"
    record = world.services.incidents.get_incident("alpha", inc["incident_id"])
    assert record is not None
    record.status, record.resolved_ns = inc["status"], 0  # as the processor still sees it
    world.services.incidents.upsert_incidents([record])
    assert world.get(path).json()["status"] == "resolved"
    world.services.incidents.upsert_runs([processor_run])  # the run's count follows, through its upserts too
    run = world.get(f"/api/v1/runs/{inc['run_id']}").json()
    assert run["open_incidents"] == processor_run.open_incidents - 1
    assert world.get(f"{path}/workflow").json()["workflow"]["root_cause"] == "LR schedule bug: warmup to 10x"

    # the same failure in a later run lists it as a similar, solved one (as the processor would record it)
    later = world.services.incidents.get_incident("alpha", inc["incident_id"])
    assert later is not None
    later.incident_id, later.run_id = "later-" + later.incident_id, "later-run"
    world.services.incidents.upsert_incidents([later])
    similar = world.get(f"/api/v1/incidents/{later.incident_id}/workflow").json()["similar"]
    assert [(s["incident_id"], s["root_cause"]) for s in similar] == [
        (inc["incident_id"], "LR schedule bug: warmup to 10x")]
    causes = world.get(f"/api/v1/incidents/{later.incident_id}/workflow").json()["confirmed_causes"]
    assert [(c["root_cause"], c["count"], c["same_fingerprint"]) for c in causes] == [
        ("LR schedule bug: warmup to 10x", 1, int(bool(inc["fingerprint"])))]
    assert world.get(f"{path}/workflow").json()["similar"] == []  # never itself


@pytest.mark.parametrize("action,body,detail", [
    ("acknowledge", {}, "body.by: Field required"),
    ("resolve", {"by": "ana"}, "body.root_cause: Field required"),
    ("resolve", {"by": "ana", "root_cause": ""}, "body.root_cause: String should have at least 1 character"),
    ("notes", {"by": "ana", "text": "x" * 4001}, "body.text: String should have at most 4000 characters"),
    ("notes", {"by": "", "text": "hello"}, "body.by: String should have at least 1 character"),
])
def test_bad_bodies_get_precise_errors(world: World, action: str, body: Dict[str, Any], detail: str) -> None:
    response = post(world, f"/api/v1/incidents/{incident_of(world)['incident_id']}/{action}", body)
    assert (response.status_code, response.json()["detail"]) == (422, detail)


def test_unknown_incidents_other_projects_and_tokens(world: World) -> None:
    assert post(world, "/api/v1/incidents/nope/acknowledge", {"by": "ana"}).status_code == 404
    alpha = incident_of(world)["incident_id"]
    # project beta's token never sees nor touches alpha's incident
    assert post(world, f"/api/v1/incidents/{alpha}/notes", {"by": "eve", "text": "hi"}, project="beta").status_code == 404
    assert world.get(f"/api/v1/incidents/{alpha}/workflow", project="beta").status_code == 404
    assert post(world, f"/api/v1/incidents/{alpha}/acknowledge", {"by": "x"}, kind="ingest").status_code == 403
    response = world.client.post(f"/api/v1/incidents/{alpha}/acknowledge", json={"by": "x"})
    assert response.status_code == 401


def test_confirmed_causes_are_merged_and_ranked() -> None:
    def solved(incident_id: str, cause: str, fingerprint: str, when: int) -> IncidentWorkflow:
        return IncidentWorkflow(project="p", incident_id=incident_id, category="memory", subtype="oom",
                                fingerprint=fingerprint, root_cause=cause, resolved_ns=when)

    library = [solved("a", "Batch too large", "fp1", 1), solved("b", "batch  too LARGE", "fp2", 2),
               solved("c", "a memory leak in eval", "fp9", 3), solved("d", "activation checkpointing off", "fp2", 4)]
    ranked = ranked_causes(library, "fp9")
    # this stack's cause first, then the most frequent (merged across case and spacing), then the most recent
    assert [(c["root_cause"], c["count"], c["same_fingerprint"]) for c in ranked] == [
        ("a memory leak in eval", 1, 1), ("Batch too large", 2, 0), ("activation checkpointing off", 1, 0)]

