"""EventStore contract, written once against the ABC and run against every implementation.

Adding an implementation is one line in IMPLEMENTATIONS: a factory taking the test's tmp_path and its
pytest request (for fixtures such as a running server) and returning an empty store.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from tests.support.elasticsearch import make_test_store
from trainguard_server.storage.base import EventStore, SearchHit, StoredEvent
from trainguard_server.storage.memory import MemoryEventStore
from trainguard_server.storage.sqlite import SqliteEventStore

Factory = Callable[[Path, pytest.FixtureRequest], EventStore]
IMPLEMENTATIONS: Dict[str, Factory] = {
    "memory": lambda tmp_path, request: MemoryEventStore(),
    "sqlite": lambda tmp_path, request: SqliteEventStore(tmp_path / "events.db"),
    "elasticsearch": lambda tmp_path, request: make_test_store(request.getfixturevalue("elasticsearch_server").url,
                                                               request),
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EventStore]:
    impl = IMPLEMENTATIONS[request.param](tmp_path, request)
    yield impl
    impl.close()


def ev(event_id: str, text: str = "", *, project: str = "p", run_id: str = "r1", kind: str = "log",
       time_ns: Optional[int] = None, step: int = 0, rank: int = 0, payload: Optional[dict] = None) -> StoredEvent:
    return StoredEvent(event_id=event_id, project=project, run_id=run_id, rank=rank, host="host-a", kind=kind,
                       severity="error", step=step, time_ns=time_ns if time_ns is not None else step,
                       text=text, payload=payload if payload is not None else {"n": step})


CORPUS = [
    ev("oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", kind="exception", step=1),
    ev("nccl", "RuntimeError: NCCL watchdog caught collective operation timeout on rank 3", kind="exception", step=2),
    ev("nan", "loss became NaN at step 1200; memory was fine", step=3),
    ev("mem-order", "memory out of range while copying", step=4),
    ev("nccl-many", "NCCL NCCL NCCL timeout", step=5),
    ev("other-run", "CUDA out of memory on another run", run_id="r2", step=6),
]


def must(event: Optional[StoredEvent]) -> StoredEvent:
    assert event is not None
    return event


def ids(hits: List[SearchHit]) -> List[str]:
    return [h.event.event_id for h in hits]


# --- put / get ---------------------------------------------------------------------------------------------

def test_put_returns_new_count_and_ignores_duplicate_event_ids(store: EventStore) -> None:
    assert store.put(CORPUS) == len(CORPUS)
    assert store.put(CORPUS) == 0
    assert store.put([ev("fresh", "x"), ev("fresh", "x again"), CORPUS[0]]) == 1
    assert store.put([]) == 0
    assert must(store.get("p", "fresh")).text == "x"  # the first copy wins; a redelivery never rewrites


def test_get_round_trips_every_field_including_non_finite_payload_values(store: EventStore) -> None:
    payload = {"metrics": {"loss": math.nan, "scale": math.inf, "floor": -math.inf}, "list": [1, "a", None],
               "unicode": "naïve ✓ \u4e2d"}
    original = ev("e1", "über text", payload=payload, time_ns=1_700_000_000_000_000_000, step=42, rank=7)
    store.put([original])
    got = store.get("p", "e1")
    assert got is not None
    assert (got.event_id, got.project, got.run_id, got.rank, got.host, got.kind, got.severity, got.step,
            got.time_ns, got.text) == ("e1", "p", "r1", 7, "host-a", "log", "error", 42,
                                       1_700_000_000_000_000_000, "über text")
    assert math.isnan(got.payload["metrics"]["loss"])
    assert got.payload["metrics"]["scale"] == math.inf and got.payload["metrics"]["floor"] == -math.inf
    assert got.payload["list"] == [1, "a", None] and got.payload["unicode"] == "naïve ✓ \u4e2d"
    assert store.get("p", "missing") is None


def test_projects_never_see_each_others_events(store: EventStore) -> None:
    store.put([ev("same-id", "secret alpha text", project="a"), ev("same-id", "beta text", project="b")])
    assert must(store.get("a", "same-id")).text == "secret alpha text"
    assert must(store.get("b", "same-id")).text == "beta text"
    assert store.get("c", "same-id") is None
    assert store.search("b", "secret").items == []
    assert ids(store.search("a", "secret").items) == ["same-id"]
    assert [e.text for e in store.list_for_run("b", "r1").items] == ["beta text"]
    assert store.list_for_run("c", "r1").items == []


# --- list_for_run -------------------------------------------------------------------------------------------

def test_list_for_run_is_oldest_first_and_filters_kinds(store: EventStore) -> None:
    store.put([ev("late", "x", time_ns=300), ev("early", "x", time_ns=100, kind="exception"),
               ev("mid", "x", time_ns=200), ev("r2", "x", run_id="r2", time_ns=50)])
    assert [e.event_id for e in store.list_for_run("p", "r1").items] == ["early", "mid", "late"]
    assert [e.event_id for e in store.list_for_run("p", "r1", kinds=["exception"]).items] == ["early"]
    assert [e.event_id for e in store.list_for_run("p", "r1", kinds=["log", "exception"]).items] == [
        "early", "mid", "late"]
    assert store.list_for_run("p", "r1", kinds=[]).items == []


def test_list_for_run_pages_are_complete_without_duplicates(store: EventStore) -> None:
    # equal timestamps force the tie-break to be part of the cursor
    store.put([ev(f"e{i:03d}", "x", time_ns=i // 4) for i in range(103)])
    seen: List[str] = []
    cursor = None
    pages = 0
    while True:
        page = store.list_for_run("p", "r1", limit=10, cursor=cursor)
        seen += [e.event_id for e in page.items]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert pages == 11
    assert sorted(seen) == [f"e{i:03d}" for i in range(103)] and len(set(seen)) == 103
    times = [e.time_ns for e in store.list_for_run("p", "r1", limit=1000).items]
    assert times == sorted(times)


def test_list_for_run_last_full_page_has_no_cursor(store: EventStore) -> None:
    store.put([ev(f"e{i}", "x", time_ns=i) for i in range(10)])
    page = store.list_for_run("p", "r1", limit=10)
    assert len(page.items) == 10 and page.next_cursor is None


@pytest.mark.parametrize("bad", ["garbage", "!!!", "eyJrIjoxfQ", "", "a" * 5000])
def test_invalid_cursor_is_a_value_error(store: EventStore, bad: str) -> None:
    store.put(CORPUS)
    for call in (lambda: store.list_for_run("p", "r1", cursor=bad), lambda: store.search("p", "memory", cursor=bad)):
        if bad == "":
            call()  # an empty cursor means the first page
            continue
        with pytest.raises(ValueError, match="invalid cursor"):
            call()


def test_a_cursor_only_works_for_the_listing_it_came_from(store: EventStore) -> None:
    store.put([ev(f"e{i}", "memory", time_ns=i) for i in range(5)] +
              [ev(f"f{i}", "memory", time_ns=i, project="q") for i in range(5)])
    cursor = store.list_for_run("p", "r1", limit=2).next_cursor
    assert cursor
    with pytest.raises(ValueError, match="invalid cursor"):
        store.list_for_run("q", "r1", cursor=cursor)  # another project
    with pytest.raises(ValueError, match="invalid cursor"):
        store.list_for_run("p", "r2", cursor=cursor)  # another run
    with pytest.raises(ValueError, match="invalid cursor"):
        store.search("p", "memory", cursor=cursor)  # another listing
    search_cursor = store.search("p", "memory", limit=2).next_cursor
    assert search_cursor
    with pytest.raises(ValueError, match="invalid cursor"):
        store.search("p", "other words", cursor=search_cursor)


@pytest.mark.parametrize("limit", [0, -1])
def test_non_positive_limit_is_a_value_error(store: EventStore, limit: int) -> None:
    with pytest.raises(ValueError):
        store.list_for_run("p", "r1", limit=limit)
    with pytest.raises(ValueError):
        store.search("p", "x", limit=limit)


# --- search -------------------------------------------------------------------------------------------------

def test_search_ands_words(store: EventStore) -> None:
    store.put(CORPUS)
    assert set(ids(store.search("p", "memory").items)) == {"oom", "nan", "mem-order", "other-run"}
    assert set(ids(store.search("p", "memory cuda").items)) == {"oom", "other-run"}
    assert set(ids(store.search("p", "memory AND cuda").items)) == {"oom", "other-run"}
    assert store.search("p", "memory nccl").items == []


def test_search_is_case_and_accent_insensitive(store: EventStore) -> None:
    store.put([ev("u", "Über Café NAÏVE")])
    assert ids(store.search("p", "uber cafe naive").items) == ["u"]
    assert ids(store.search("p", "ÜBER").items) == ["u"]


def test_quoted_phrases_match_exactly(store: EventStore) -> None:
    store.put(CORPUS)
    assert set(ids(store.search("p", '"out of memory"').items)) == {"oom", "other-run"}
    assert ids(store.search("p", '"memory out"').items) == ["mem-order"]
    assert ids(store.search("p", '"out of memory" "2.00 GiB"').items) == ["oom"]
    assert store.search("p", '"memory of out"').items == []
    # punctuation inside a phrase is a token separator, as in the text
    assert ids(store.search("p", '"torch.OutOfMemoryError"').items) == ["oom"]


def test_prefix_search(store: EventStore) -> None:
    store.put(CORPUS)
    assert set(ids(store.search("p", "memo*").items)) == {"oom", "nan", "mem-order", "other-run"}
    assert set(ids(store.search("p", "OutOfMem*").items)) == {"oom"}
    assert set(ids(store.search("p", "time*").items)) == {"nccl", "nccl-many"}
    assert ids(store.search("p", '"operation time"*').items) == ["nccl"]


def test_run_filter(store: EventStore) -> None:
    store.put(CORPUS)
    assert ids(store.search("p", '"out of memory"', run_id="r2").items) == ["other-run"]
    assert ids(store.search("p", '"out of memory"', run_id="r1").items) == ["oom"]
    assert store.search("p", '"out of memory"', run_id="nope").items == []


def test_best_match_first_with_positive_scores(store: EventStore) -> None:
    store.put(CORPUS + [ev(f"filler{i}", "unrelated filler words only") for i in range(20)])
    hits = store.search("p", "nccl").items
    assert ids(hits) == ["nccl-many", "nccl"]
    assert hits[0].score > hits[1].score > 0


def test_snippets_mark_matches_in_brackets(store: EventStore) -> None:
    store.put(CORPUS)
    (hit,) = store.search("p", "watchdog").items
    assert "[watchdog]" in hit.snippet
    (hit,) = store.search("p", '"out of memory"', run_id="r1").items
    assert "[out of memory]" in hit.snippet
    (hit,) = store.search("p", "outofmem*").items
    assert "[torch.OutOfMemoryError]" in hit.snippet or "[OutOfMemoryError]" in hit.snippet


def test_search_pages_are_complete_without_duplicates(store: EventStore) -> None:
    # many equal scores: the tie-break must be part of the cursor
    store.put([ev(f"e{i:03d}", f"gradient explosion {'spike ' * (i % 3)}") for i in range(57)])
    seen: List[str] = []
    scores: List[float] = []
    cursor = None
    while True:
        page = store.search("p", "gradient", limit=8, cursor=cursor)
        assert len(page.items) <= 8
        seen += ids(page.items)
        scores += [h.score for h in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == [f"e{i:03d}" for i in range(57)]
    assert scores == sorted(scores, reverse=True)


def test_search_pagination_ignores_events_stored_after_it_started(store: EventStore) -> None:
    store.put([ev(f"e{i:02d}", "checkpoint saved") for i in range(10)])
    first = store.search("p", "checkpoint", limit=4)
    store.put([ev(f"late{i}", "checkpoint saved") for i in range(5)])
    seen = ids(first.items)
    cursor = first.next_cursor
    while cursor:
        page = store.search("p", "checkpoint", limit=4, cursor=cursor)
        seen += ids(page.items)
        cursor = page.next_cursor
    assert sorted(seen) == [f"e{i:02d}" for i in range(10)]
    assert len(store.search("p", "checkpoint", limit=100).items) == 15  # a new search sees them


@pytest.mark.parametrize("query, message", [
    ("", "empty"),
    ("   ", "empty"),
    ('"out of memory', "unbalanced quote"),
    ('memory "', "unbalanced quote"),
    ("*", "prefix"),
    ("memory OR nccl", "OR is not supported"),
    ("NOT memory", "NOT is not supported"),
    ("!!! ---", "no searchable words"),
    ("x" * 2000, "too long"),
    (" ".join(f"w{i}" for i in range(40)), "too many terms"),
])
def test_unparseable_queries_are_value_errors_with_a_message(store: EventStore, query: str, message: str) -> None:
    store.put(CORPUS)
    with pytest.raises(ValueError, match=message):
        store.search("p", query)


@pytest.mark.parametrize("query", [
    "NEAR(memory cuda)", "text:memory", "memory^", "(memory", "memory)", "-memory", "+memory", "{text}: x",
    "'memory'", "memory AND", "AND", "a:b:c", "memory*cuda", "**memory", "col : memory", "\\ memory", "%_",
    "memory\x00", "\"\"", "🔥 memory", "x'); DROP TABLE events; --",
])
def test_fts_syntax_in_user_input_never_escapes_as_an_error(store: EventStore, query: str) -> None:
    store.put(CORPUS)
    try:
        page = store.search("p", query)
    except ValueError as exc:
        assert str(exc)  # a message for the user
    else:
        assert all(isinstance(h, SearchHit) for h in page.items)
    assert store.get("p", "oom") is not None
