"""IncidentStore contract, written once against the ABC and run against every implementation.

Adding an implementation is one line in IMPLEMENTATIONS (factory: tmp_path, pytest request → empty store).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from tests.services.storage.conftest import fresh_schema, postgres_dsn
from trainguard_engine.records import Cluster, Evidence, Incident, RunRecord, TimelineEntry
from trainguard_server.storage.base import IncidentBrief, IncidentStore, IncidentWorkflow, Page
from trainguard_server.storage.memory import MemoryIncidentStore
from trainguard_server.storage.postgres import PostgresIncidentStore
from trainguard_server.storage.sqlite import SqliteIncidentStore

Factory = Callable[[Path, pytest.FixtureRequest], IncidentStore]
IMPLEMENTATIONS: Dict[str, Factory] = {
    "memory": lambda tmp_path, request: MemoryIncidentStore(),
    "postgres": lambda tmp_path, request: PostgresIncidentStore(postgres_dsn(request), schema=fresh_schema()),
    "sqlite": lambda tmp_path, request: SqliteIncidentStore(tmp_path / "incidents.db"),
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[IncidentStore]:
    impl = IMPLEMENTATIONS[request.param](tmp_path, request)
    yield impl
    impl.close()


def run(run_id: str, last_event_ns: int = 0, *, project: str = "p", status: str = "running",
        tags: Optional[Dict[str, str]] = None) -> RunRecord:
    return RunRecord(project=project, run_id=run_id, run_name=f"name-{run_id}", status=status,
                     started_ns=1, last_event_ns=last_event_ns, last_step=10, world_size=2, ranks=[0, 1],
                     hosts=["h0"], tags=tags or {}, exit_codes={"1": 137}, step_time_s=0.25)


def incident(incident_id: str, first_ns: int = 0, *, project: str = "p", run_id: str = "r1",
             status: str = "open") -> Incident:
    return Incident(incident_id=incident_id, project=project, run_id=run_id, category="loss", subtype="non_finite",
                    severity="critical", status=status, title="loss became NaN", first_step=120, last_step=130,
                    first_ns=first_ns, last_ns=first_ns + 5, lead_rank=1, ranks=[0, 1], hosts=["h0"],
                    fingerprint="fp:v1:abc", checks=["check the data"],
                    evidence=[Evidence(rule="loss.non_finite", description="loss is NaN", step=120, rank=1,
                                       metric="loss", threshold=None, value=math.nan,
                                       window=[{"step": 119, "value": 2.5}, {"step": 120, "value": "NaN"}])],
                    timeline=[TimelineEntry(time_ns=first_ns, step=120, rank=1, what="loss became NaN")], count=3)


def cluster(fingerprint: str, last_ns: int = 0, *, project: str = "p") -> Cluster:
    return Cluster(project=project, fingerprint=fingerprint, fingerprint_version="fp:v1", exc_type="RuntimeError",
                   message_template="CUDA out of memory. Tried to allocate <size>", count=4, first_ns=1,
                   last_ns=last_ns, runs=["r1", "r2"], ranks=["r1:0"], hosts=["h0"], sample_event_id="e1",
                   sample={"type": "RuntimeError", "frames": [{"module": "train", "function": "step"}]})


def collect(fetch: Callable[[Optional[str]], Page[Any]], key: Callable[[Any], str]) -> List[str]:
    """Every item of a paginated listing, in order."""
    out: List[str] = []
    cursor = None
    while True:
        page = fetch(cursor)
        out += [key(item) for item in page.items]
        if page.next_cursor is None:
            return out
        cursor = page.next_cursor


# --- runs ---------------------------------------------------------------------------------------------------

def test_run_round_trip_and_upsert_replaces(store: IncidentStore) -> None:
    original = run("r1", 100, tags={"model": "gpt", "lr": "3e-4"})
    store.upsert_runs([original])
    assert store.get_run("p", "r1") == original
    changed = run("r1", 200, status="failed", tags={"model": "llama"})
    store.upsert_runs([changed])
    assert store.get_run("p", "r1") == changed
    assert store.get_run("p", "missing") is None
    assert [r.run_id for r in store.list_runs("p").items] == ["r1"]


def test_returned_records_are_copies(store: IncidentStore) -> None:
    store.upsert_runs([run("r1", tags={"a": "1"})])
    got = store.get_run("p", "r1")
    assert got is not None
    got.tags["a"] = "mutated"
    got.ranks.append(99)
    assert store.get_run("p", "r1") == run("r1", tags={"a": "1"})


def test_runs_are_listed_most_recently_active_first(store: IncidentStore) -> None:
    store.upsert_runs([run("a", 100), run("b", 300), run("c", 200), run("d", 300)])
    assert [r.run_id for r in store.list_runs("p").items] == ["b", "d", "c", "a"]


def test_run_filters_by_status_and_tag(store: IncidentStore) -> None:
    store.upsert_runs([run("a", 1, status="failed", tags={"team": "nlp", "gpu": "h100"}),
                       run("b", 2, status="running", tags={"team": "vision"}),
                       run("c", 3, status="failed", tags={"team": "nlp"}),
                       run("d", 4, tags={"eq": "x=y"})])
    assert [r.run_id for r in store.list_runs("p", status="failed").items] == ["c", "a"]
    assert [r.run_id for r in store.list_runs("p", tag="team=nlp").items] == ["c", "a"]
    assert [r.run_id for r in store.list_runs("p", tag="team").items] == ["c", "b", "a"]
    assert [r.run_id for r in store.list_runs("p", tag="gpu=h100", status="failed").items] == ["a"]
    assert [r.run_id for r in store.list_runs("p", tag="eq=x=y").items] == ["d"]  # value may hold '='
    assert [r.run_id for r in store.list_runs("p", tag="team=").items] == []  # empty value, exactly
    assert store.list_runs("p", tag="team=nlp", status="running").items == []
    store.upsert_runs([run("a", 5, status="failed", tags={"team": "infra"})])  # tags are replaced
    assert [r.run_id for r in store.list_runs("p", tag="team=nlp").items] == ["c"]
    assert [r.run_id for r in store.list_runs("p", tag="gpu").items] == []


@pytest.mark.parametrize("tag", ["=x", "", " =nlp"])
def test_invalid_tag_filter_is_a_value_error(store: IncidentStore, tag: str) -> None:
    with pytest.raises(ValueError, match="tag"):
        store.list_runs("p", tag=tag)


def test_run_pages_are_complete_without_duplicates(store: IncidentStore) -> None:
    store.upsert_runs([run(f"r{i:03d}", i // 3) for i in range(47)])
    listed = collect(lambda c: store.list_runs("p", limit=5, cursor=c), lambda r: r.run_id)
    assert len(listed) == 47 and set(listed) == {f"r{i:03d}" for i in range(47)}
    expected = [r.run_id for r in sorted((run(f"r{i:03d}", i // 3) for i in range(47)),
                                         key=lambda r: (-r.last_event_ns, r.run_id))]
    assert listed == expected


def test_run_pagination_has_no_duplicates_while_runs_keep_reporting(store: IncidentStore) -> None:
    store.upsert_runs([run(f"r{i:02d}", 100 + i) for i in range(20)])
    seen: List[str] = []
    page = store.list_runs("p", limit=5)
    seen += [r.run_id for r in page.items]
    store.upsert_runs([run("r19", 1000), run("r00", 1001)])  # activity moves runs to the front
    while page.next_cursor:
        page = store.list_runs("p", limit=5, cursor=page.next_cursor)
        seen += [r.run_id for r in page.items]
    assert len(seen) == len(set(seen))


def test_projects_never_see_each_others_records(store: IncidentStore) -> None:
    store.upsert_runs([run("shared", 1, project="a", tags={"t": "1"}), run("shared", 2, project="b")])
    store.upsert_incidents([incident("i1", project="a", run_id="shared"), incident("i2", project="b")])
    store.upsert_clusters([cluster("fp1", project="a"), cluster("fp2", project="b")])
    run_a, run_b = store.get_run("a", "shared"), store.get_run("b", "shared")
    assert run_a is not None and run_b is not None
    assert (run_a.last_event_ns, run_b.last_event_ns) == (1, 2)
    assert [r.project for r in store.list_runs("a").items] == ["a"]
    assert store.list_runs("b", tag="t").items == []
    assert store.get_incident("b", "i1") is None and store.get_incident("a", "i1") is not None
    assert [i.incident_id for i in store.list_incidents("b").items] == ["i2"]
    assert store.list_incidents("b", run_id="shared").items == []
    assert store.get_cluster("b", "fp1") is None
    assert [c.fingerprint for c in store.list_clusters("a").items] == ["fp1"]
    assert store.list_runs("c").items == [] and store.list_incidents("c").items == []
    assert store.list_clusters("c").items == []


# --- incidents ----------------------------------------------------------------------------------------------

def test_incident_round_trip_with_evidence_timeline_and_nan(store: IncidentStore) -> None:
    store.upsert_incidents([incident("i1", 50)])
    got = store.get_incident("p", "i1")
    assert got is not None
    assert isinstance(got.evidence[0], Evidence) and isinstance(got.timeline[0], TimelineEntry)
    assert math.isnan(got.evidence[0].value)
    got.evidence[0].value = None
    expected = incident("i1", 50)
    expected.evidence[0].value = None
    assert got == expected
    store.upsert_incidents([incident("i1", 50, status="resolved")])
    resolved = store.get_incident("p", "i1")
    assert resolved is not None and resolved.status == "resolved"
    assert store.get_incident("p", "nope") is None


def test_incidents_are_listed_most_recent_first_and_filter(store: IncidentStore) -> None:
    store.upsert_incidents([incident("a", 10, run_id="r1"), incident("b", 30, run_id="r2"),
                            incident("c", 20, run_id="r1", status="resolved"), incident("d", 30, run_id="r1")])
    assert [i.incident_id for i in store.list_incidents("p").items] == ["b", "d", "c", "a"]
    assert [i.incident_id for i in store.list_incidents("p", run_id="r1").items] == ["d", "c", "a"]
    assert [i.incident_id for i in store.list_incidents("p", status="resolved").items] == ["c"]
    assert [i.incident_id for i in store.list_incidents("p", run_id="r1", status="open").items] == ["d", "a"]


def test_incident_pages_are_complete_without_duplicates(store: IncidentStore) -> None:
    store.upsert_incidents([incident(f"i{i:03d}", i % 4, run_id=f"r{i % 2}") for i in range(33)])
    listed = collect(lambda c: store.list_incidents("p", limit=4, cursor=c), lambda i: i.incident_id)
    assert sorted(listed) == [f"i{i:03d}" for i in range(33)]
    by_run = collect(lambda c: store.list_incidents("p", run_id="r1", limit=3, cursor=c), lambda i: i.incident_id)
    assert sorted(by_run) == [f"i{i:03d}" for i in range(1, 33, 2)]


# --- clusters -----------------------------------------------------------------------------------------------

def test_cluster_round_trip_and_ordering(store: IncidentStore) -> None:
    store.upsert_clusters([cluster("old", 10), cluster("new", 30), cluster("mid", 20)])
    assert store.get_cluster("p", "new") == cluster("new", 30)
    assert [c.fingerprint for c in store.list_clusters("p").items] == ["new", "mid", "old"]
    store.upsert_clusters([cluster("old", 40)])
    assert [c.fingerprint for c in store.list_clusters("p").items] == ["old", "new", "mid"]
    listed = collect(lambda c: store.list_clusters("p", limit=2, cursor=c), lambda c: c.fingerprint)
    assert listed == ["old", "new", "mid"]


# --- cursors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["x", "bm90IGpzb24", "eyJrIjoicnVucyIsInMiOiIiLCJ2IjpbMSwiYSJdfQ", "%%%", "=" * 10])
def test_invalid_cursors_are_value_errors(store: IncidentStore, bad: str) -> None:
    store.upsert_runs([run(f"r{i}", i) for i in range(3)])
    for call in (lambda: store.list_runs("p", cursor=bad), lambda: store.list_incidents("p", cursor=bad),
                 lambda: store.list_clusters("p", cursor=bad)):
        with pytest.raises(ValueError, match="invalid cursor"):
            call()


def test_cursors_only_work_for_their_listing_and_filters(store: IncidentStore) -> None:
    store.upsert_runs([run(f"r{i}", i, status="failed") for i in range(5)])
    store.upsert_incidents([incident(f"i{i}", i) for i in range(5)])
    runs_cursor = store.list_runs("p", limit=2).next_cursor
    failed_cursor = store.list_runs("p", status="failed", limit=2).next_cursor
    assert runs_cursor and failed_cursor
    for call in (lambda: store.list_incidents("p", cursor=runs_cursor),
                 lambda: store.list_clusters("p", cursor=runs_cursor),
                 lambda: store.list_runs("other", cursor=runs_cursor),
                 lambda: store.list_runs("p", cursor=failed_cursor),
                 lambda: store.list_runs("p", status="running", cursor=failed_cursor)):
        with pytest.raises(ValueError, match="invalid cursor"):
            call()


def test_non_positive_limit_is_a_value_error(store: IncidentStore) -> None:
    for call in (lambda: store.list_runs("p", limit=0), lambda: store.list_incidents("p", limit=-1),
                 lambda: store.list_clusters("p", limit=0)):
        with pytest.raises(ValueError):
            call()


# --- state --------------------------------------------------------------------------------------------------

def test_state_blobs_round_trip_and_overwrite(store: IncidentStore) -> None:
    assert store.load_state("processor") is None
    blob = bytes(range(256)) * 1000
    store.save_state("processor", blob)
    assert store.load_state("processor") == blob
    store.save_state("processor", b"")
    assert store.load_state("processor") == b""
    store.save_state("other", b"x")
    assert store.load_state("processor") == b"" and store.load_state("other") == b"x"


def test_save_states_writes_and_deletes_all_at_once_or_nothing(store: IncidentStore) -> None:
    store.save_state("snap/old", b"old")
    store.save_states({"snap/a": b"1", "snap/b": b"\x00" * 100_000, "snap/old": None, "snap/absent": None})
    assert store.state_keys("snap/") == ["snap/a", "snap/b"]
    assert store.load_state("snap/b") == b"\x00" * 100_000 and store.load_state("snap/old") is None
    with pytest.raises(TypeError):  # the last value is not bytes: the first two must not be written
        store.save_states({"snap/a": b"2", "snap/c": b"3", "snap/d": "text"})  # type: ignore[dict-item]
    assert store.load_state("snap/a") == b"1" and store.load_state("snap/c") is None
    store.save_states({})
    assert store.state_keys("snap/") == ["snap/a", "snap/b"]


def test_state_keys_lists_a_literal_prefix_in_order(store: IncidentStore) -> None:
    for key in ("gate.baseline/p/b", "gate.baseline/p/a", "gate.baseline/p2/a", "gate.baseline/p_x/a",
                "gate.baselinez", "processor"):
        store.save_state(key, b"1")
    assert store.state_keys("gate.baseline/p/") == ["gate.baseline/p/a", "gate.baseline/p/b"]
    assert store.state_keys("gate.baseline/p_") == ["gate.baseline/p_x/a"]  # '_' is no wildcard
    assert store.state_keys("gate.baseline/%") == []
    assert store.state_keys("nothing/") == []
    assert len(store.state_keys("")) == 6


def test_upserting_nothing_is_a_no_op(store: IncidentStore) -> None:
    store.upsert_runs([])
    store.upsert_incidents([])
    store.upsert_clusters([])
    assert store.list_runs("p").items == []


def test_get_workflows_reads_many_at_once_within_the_project(store: IncidentStore) -> None:
    """What the API reads to show a page of runs or incidents: the workflows of the ids that have one, keyed
    by id -- each equal to get_workflow's, none of another project's, unknown and repeated ids harmless, and
    more ids than one SQL statement can bind."""
    store.save_workflow(IncidentWorkflow(project="p", incident_id="a", run_id="r1", category="loss",
                                         subtype="non_finite", resolved_by="bo", resolved_ns=20, root_cause="lr",
                                         notes=[{"by": "ana", "time_ns": 11, "text": "on it"}]))
    store.save_workflow(IncidentWorkflow(project="p", incident_id="b", acknowledged_by="ana", acknowledged_ns=5))
    store.save_workflow(IncidentWorkflow(project="q", incident_id="c", resolved_ns=40))
    got = store.get_workflows("p", ["a", "zz", "b", "c", "a"])
    assert sorted(got) == ["a", "b"]
    for incident_id, workflow in got.items():
        assert workflow == store.get_workflow("p", incident_id)
    assert got["a"].resolved_ns == 20 and got["a"].notes[0]["text"] == "on it" and got["b"].resolved_ns == 0
    assert store.get_workflows("p", []) == {}
    assert sorted(store.get_workflows("q", ["a", "c"])) == ["c"]
    for i in range(1200):
        if i % 400 == 7:
            store.save_workflow(IncidentWorkflow(project="p", incident_id=f"many-{i}", resolved_ns=i))
    many = store.get_workflows("p", [f"many-{i}" for i in range(1200)] + ["a"])
    assert {k: w.resolved_ns for k, w in many.items()} == {"many-7": 7, "many-407": 407, "many-807": 807,
                                                          "a": 20}


def test_incident_briefs_of_many_runs_are_their_listings_in_short(store: IncidentStore) -> None:
    """What the API reads to recount a page of runs: each run's incidents as briefs in list_incidents order,
    [] for a run without any, None for one over the limit; another project's runs of the same id apart."""
    store.upsert_incidents([incident(f"a{i}", 10 + i, run_id="r1", status="open" if i % 2 else "resolved")
                            for i in range(4)] + [incident("b0", 5, run_id="r2"), incident("b1", 5, run_id="r2"),
                                                  incident("q0", 1, run_id="r1", project="q")])
    stall = incident("s0", 7, run_id="r3", status="ongoing")
    stall.category, stall.subtype, stall.severity = "progress", "stalled", "warning"
    odd = incident("n0", 8, run_id="r4")  # names that spell JSON's missing tokens (a store must not trip on them)
    odd.category, odd.subtype, odd.severity = "Infinity", "NaN-null", "1e999"
    store.upsert_incidents([stall, odd])
    briefs = store.incident_briefs("p", ["r1", "r2", "r3", "none", "r1", "r4"])
    assert list(briefs) == ["r1", "r2", "r3", "none", "r4"] and briefs["none"] == []
    assert (briefs["r4"] or [])[0][3:] == ("Infinity", "NaN-null", "1e999")
    for run_id in ("r1", "r2", "r3", "r4"):
        listed = store.list_incidents("p", run_id=run_id, limit=500).items
        assert briefs[run_id] == [IncidentBrief(i.incident_id, i.run_id, i.status, i.category, i.subtype,
                                                i.severity) for i in listed]
    assert [b.incident_id for b in briefs["r1"] or []] == ["a3", "a2", "a1", "a0"]
    assert (briefs["r3"] or [])[0][2:] == ("ongoing", "progress", "stalled", "warning")
    assert store.incident_briefs("p", ["r1", "r2"], limit=3) == {"r1": None, "r2": briefs["r2"]}
    assert [b.incident_id for b in store.incident_briefs("q", ["r1"])["r1"] or []] == ["q0"]
    assert store.incident_briefs("p", []) == {}


def test_upsert_records_is_the_three_upserts(store: IncidentStore) -> None:
    """The processor's one write per round: runs (with their tags), incidents and clusters as the three
    upserts store them, later records replacing earlier ones; empty parts are fine."""
    store.upsert_records([run("r1", 5, tags={"a": "1"}), run("r2", 6)], [incident("i1", 3), incident("i2", 4)],
                         [cluster("fp1", 7)])
    store.upsert_records([run("r1", 8, status="failed", tags={"b": "2"})], [incident("i1", 3, status="resolved")],
                         [])
    store.upsert_records([], [], [cluster("fp2", 9)])
    store.upsert_records([], [], [])
    assert [(r.run_id, r.status) for r in store.list_runs("p").items] == [("r1", "failed"), ("r2", "running")]
    assert [r.run_id for r in store.list_runs("p", tag="b=2").items] == ["r1"]
    assert store.list_runs("p", tag="a").items == []  # the tags of the record that replaced it
    assert [(i.incident_id, i.status) for i in store.list_incidents("p").items] == [("i2", "open"),
                                                                                      ("i1", "resolved")]
    assert [c.fingerprint for c in store.list_clusters("p").items] == ["fp2", "fp1"]


def test_workflow_round_trip_survives_incident_upserts_and_builds_the_library(store: IncidentStore) -> None:
    store.upsert_incidents([incident("a", 1), incident("b", 2, run_id="r2"), incident("c", 3, project="q")])
    assert store.get_workflow("p", "a") is None
    store.save_workflow(IncidentWorkflow(project="p", incident_id="a", run_id="r1", category="loss",
                                         subtype="non_finite", fingerprint="fp:v1:abc", acknowledged_by="ana",
                                         acknowledged_ns=10, notes=[{"by": "ana", "time_ns": 11, "text": "on it"}]))
    store.upsert_incidents([incident("a", 1, status="ongoing")])  # the processor's upsert: workflow untouched
    got = store.get_workflow("p", "a")
    assert got is not None and got.acknowledged_by == "ana" and got.notes[0]["text"] == "on it"
    assert store.resolved_like("p", "loss", "non_finite") == []  # acknowledged, not resolved
    for incident_id, when, cause in (("a", 20, "lr schedule restarted at 1e-2"), ("b", 30, "a corrupt shard")):
        w = store.get_workflow("p", incident_id) or IncidentWorkflow(project="p", incident_id=incident_id)
        w.category, w.subtype, w.resolved_by, w.resolved_ns, w.root_cause = "loss", "non_finite", "bo", when, cause
        store.save_workflow(w)
    store.save_workflow(IncidentWorkflow(project="q", incident_id="c", category="loss", subtype="non_finite",
                                         resolved_ns=40, root_cause="other project"))
    library = store.resolved_like("p", "loss", "non_finite")
    assert [(w.incident_id, w.root_cause) for w in library] == [("b", "a corrupt shard"),
                                                                 ("a", "lr schedule restarted at 1e-2")]
    assert store.resolved_like("p", "loss", "non_finite", limit=1)[0].incident_id == "b"
    assert store.resolved_like("p", "gradient", "explosion") == []
    assert [w.incident_id for w in store.resolved_like("q", "loss", "non_finite")] == ["c"]
