"""What the EventStore contract cannot see of the Elasticsearch store: the template and daily indices it
makes, bulk retries on 429/5xx (through a fault-injecting proxy in front of the real server), rejected
events reported rather than lost, retention by dropping indices, and refresh semantics. Everything runs
against a real Elasticsearch API (noida-db, tests/support/elasticsearch.py)."""

from __future__ import annotations

import time
from typing import Any, Iterator, List

import pytest
from elasticsearch import Elasticsearch

from tests.support.elasticsearch import FaultProxy, NoidaElasticsearch, make_test_store
from tests.support.net import free_port
from trainguard_server.storage.base import StoredEvent
from trainguard_server.storage.elasticsearch import (
    ElasticsearchEventStore,
    ElasticsearchUnavailable,
    EventIndexingError,
    document_id,
    index_day,
)

DAY_NS = 86_400 * 10**9
T0 = 1_700_000_000 * 10**9          # 2023-11-14T22:13:20Z


def ev(event_id: str, text: str = "some text", *, time_ns: int = T0, project: str = "p", run_id: str = "r1",
       payload: Any = None) -> StoredEvent:
    return StoredEvent(event_id=event_id, project=project, run_id=run_id, rank=0, host="h", kind="log",
                       severity="error", step=1, time_ns=time_ns, text=text,
                       payload=payload if payload is not None else {"event_id": event_id})


@pytest.fixture
def server(elasticsearch_server: NoidaElasticsearch) -> NoidaElasticsearch:
    return elasticsearch_server


@pytest.fixture
def proxy(server: NoidaElasticsearch) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(server.port)
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture
def raw(server: NoidaElasticsearch) -> Iterator[Elasticsearch]:
    client = Elasticsearch(server.url)
    yield client
    client.close()


def all_ids(store: ElasticsearchEventStore, project: str = "p", run_id: str = "r1") -> List[str]:
    return sorted(e.event_id for e in store.list_for_run(project, run_id, limit=1000).items)


# --- template, indices, documents ------------------------------------------------------------------------

def test_daily_indices_get_the_templates_settings_and_strict_mapping(server: NoidaElasticsearch,
                                                                      raw: Elasticsearch,
                                                                      request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request)
    exception = {"exception": {"type": "RuntimeError", "fingerprint": "c8dc67fb420676dfa7a7b0c4b4808f78"}}
    assert store.put([ev("a", time_ns=T0, payload=exception), ev("b", time_ns=T0 + DAY_NS)]) == 2
    day0, day1 = index_day(T0), index_day(T0 + DAY_NS)
    assert (day0, day1) == ("2023.11.14", "2023.11.15")
    assert store.indices() == [f"{store.prefix}-events-{day0}", f"{store.prefix}-events-{day1}"]

    name = store.indices()[0]
    mapping = raw.indices.get_mapping(index=name)[name]["mappings"]
    assert mapping["dynamic"] == "strict"
    props = mapping["properties"]
    for keyword in ("uid", "event_id", "project", "run_id", "host", "kind", "severity", "fingerprint"):
        assert props[keyword]["type"] == "keyword", keyword
    assert props["text"] == {"type": "text", "analyzer": "tg_text"}
    assert props["payload"]["index"] is False and props["payload"]["doc_values"] is False
    settings = raw.indices.get_settings(index=name)[name]["settings"]["index"]
    assert settings["analysis"]["analyzer"]["tg_text"]["filter"] == ["lowercase", "asciifolding", "tg_truncate"]
    assert settings["number_of_replicas"] == "0"

    doc = raw.get(index=name, id=document_id("p", "a"))["_source"]
    assert doc["fingerprint"] == "c8dc67fb420676dfa7a7b0c4b4808f78"
    assert doc["@timestamp"] == T0 // 1_000_000 and doc["time_ns"] == T0
    assert isinstance(doc["payload"], str)  # JSON text: envelopes carry NaN/Inf


def test_a_document_with_a_field_outside_the_mapping_is_refused(server: NoidaElasticsearch,
                                                                raw: Elasticsearch,
                                                                request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request)
    store.put([ev("a")])
    answer = raw.options(ignore_status=400).index(index=store.indices()[0], id="x", document={"surprise": 1})
    assert answer.meta.status == 400 and "strict" in str(answer.body)


def test_many_events_are_written_in_chunks(server: NoidaElasticsearch, proxy: FaultProxy,
                                           request: pytest.FixtureRequest) -> None:
    store = make_test_store(proxy.url, request, chunk_docs=7)
    assert store.put([ev(f"e{i:02d}") for i in range(30)]) == 30
    assert proxy.bulk_requests == 5
    assert all_ids(store) == [f"e{i:02d}" for i in range(30)]


# --- retries and rejections ------------------------------------------------------------------------------

@pytest.mark.parametrize("status, error_type", [(429, "es_rejected_execution_exception"),
                                                (503, "unavailable_shards_exception")])
def test_items_answered_429_or_5xx_are_retried_until_stored(server: NoidaElasticsearch, proxy: FaultProxy,
                                                            request: pytest.FixtureRequest, status: int,
                                                            error_type: str) -> None:
    store = make_test_store(proxy.url, request)
    proxy.fail_items(status, error_type, n=2, first=4)  # two answers in a row refuse the first 4 items
    assert store.put([ev(f"e{i}") for i in range(10)]) == 10
    assert store.retries == 2 and proxy.bulk_requests == 3
    assert all_ids(store) == [f"e{i}" for i in range(10)]


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_whole_bulk_requests_answered_429_or_5xx_are_retried(server: NoidaElasticsearch, proxy: FaultProxy,
                                                             request: pytest.FixtureRequest, status: int) -> None:
    store = make_test_store(proxy.url, request)
    proxy.fail_requests(status, n=3)
    assert store.put([ev("a"), ev("b")]) == 2
    assert store.retries == 3
    assert all_ids(store) == ["a", "b"]


def test_a_cluster_that_keeps_failing_raises_and_a_later_retry_of_the_batch_is_safe(
        server: NoidaElasticsearch, proxy: FaultProxy, request: pytest.FixtureRequest) -> None:
    store = make_test_store(proxy.url, request, max_retries=2)
    proxy.fail_requests(503, n=3)
    with pytest.raises(ElasticsearchUnavailable, match="3 times"):
        store.put([ev("a"), ev("b")])
    assert store.put([ev("a"), ev("b")]) == 2  # the processor re-applies the batch: nothing lost


def test_no_server_at_all_raises_after_the_retries() -> None:
    store = ElasticsearchEventStore(hosts=f"http://127.0.0.1:{free_port()}", max_retries=1,
                                    initial_backoff_s=0.01, max_backoff_s=0.05)
    started = time.monotonic()
    with pytest.raises(ElasticsearchUnavailable, match="failed 2 times"):
        store.put([ev("a")])
    assert time.monotonic() - started < 10 and store.retries == 1
    store.close()


def test_items_still_refused_after_the_retries_are_reported_by_name(server: NoidaElasticsearch,
                                                                    proxy: FaultProxy,
                                                                    request: pytest.FixtureRequest) -> None:
    store = make_test_store(proxy.url, request, max_retries=2)
    proxy.fail_items(429, "es_rejected_execution_exception", n=3, first=1)
    with pytest.raises(EventIndexingError) as info:
        store.put([ev("first"), ev("second")])
    (rejected,) = info.value.rejected
    assert (rejected.event_id, rejected.status) == ("first", 429)
    assert "after 3 attempts" in rejected.error and "es_rejected_execution_exception" in rejected.error
    assert info.value.new == 1 and all_ids(store) == ["second"]


def test_a_rejected_document_is_reported_and_the_rest_of_the_batch_is_stored(
        server: NoidaElasticsearch, raw: Elasticsearch, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    """A real 400 from the server: the day's index was made by hand with a conflicting mapping."""
    store = make_test_store(server.url, request)
    store.ensure_template()
    bad_day = T0 + 3 * DAY_NS
    raw.indices.create(index=store.index_for(bad_day), mappings={"properties": {"rank": {"type": "boolean"}}})
    with pytest.raises(EventIndexingError) as info:
        store.put([ev("ok1"), ev("bad", time_ns=bad_day), ev("ok2", time_ns=T0 + DAY_NS)])
    (rejected,) = info.value.rejected
    assert rejected.event_id == "bad" and rejected.status == 400
    assert "document_parsing_exception" in rejected.error and "rank" in rejected.error
    assert "p/bad" in str(info.value) and "p/bad" in caplog.text
    assert info.value.new == 2 and store.rejected == 1
    assert all_ids(store) == ["ok1", "ok2"]


def test_an_index_missing_on_a_cluster_without_auto_create_is_created(server: NoidaElasticsearch,
                                                                      proxy: FaultProxy,
                                                                      request: pytest.FixtureRequest) -> None:
    store = make_test_store(proxy.url, request)
    proxy.fail_items(404, "index_not_found_exception", n=1, first=1)
    assert store.put([ev("a"), ev("b")]) == 2
    assert store.retries == 1 and all_ids(store) == ["a", "b"]


def test_a_redelivered_batch_is_counted_as_duplicates_and_never_rewritten(server: NoidaElasticsearch,
                                                                          request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request)
    assert store.put([ev("a", "first copy"), ev("b")]) == 2
    assert store.put([ev("a", "second copy"), ev("b"), ev("c")]) == 1
    got = store.get("p", "a")
    assert got is not None and got.text == "first copy"


# --- retention -------------------------------------------------------------------------------------------

def test_retention_drops_whole_days_older_than_the_limit(server: NoidaElasticsearch,
                                                         request: pytest.FixtureRequest) -> None:
    now = T0 + 40 * DAY_NS
    store = make_test_store(server.url, request, retention_days=30, retention_check_s=1e9)
    store._last_retention = time.monotonic()  # keep put() from running it with today's clock
    store.put([ev("d0", time_ns=T0), ev("d9", time_ns=T0 + 9 * DAY_NS), ev("d10", time_ns=T0 + 10 * DAY_NS),
               ev("d40", time_ns=now)])
    dropped = store.drop_expired_indices(now_ns=now)
    assert dropped == [store.index_for(T0), store.index_for(T0 + 9 * DAY_NS)]
    assert all_ids(store) == ["d10", "d40"]
    assert store.get("p", "d0") is None
    assert store.drop_expired_indices(now_ns=now) == []
    with pytest.raises(ValueError, match="retention_days"):
        ElasticsearchEventStore(hosts=server.url, retention_days=0)


def test_put_runs_retention_at_most_once_per_interval(server: NoidaElasticsearch,
                                                      request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request, retention_days=30, retention_check_s=3600)
    old = time.time_ns() - 60 * DAY_NS
    store.put([ev("new", time_ns=time.time_ns())])     # first put: retention runs (nothing to drop)
    store.put([ev("old", time_ns=old)])                # within the interval: it does not run again
    assert store.get("p", "old") is not None
    store._last_retention -= 3601
    store.put([ev("new2", time_ns=time.time_ns())])
    assert store.get("p", "old") is None and store.get("p", "new") is not None


# --- visibility ------------------------------------------------------------------------------------------

def test_a_store_reads_its_writes_and_other_readers_see_them_after_a_refresh(
        server: NoidaElasticsearch, request: pytest.FixtureRequest) -> None:
    # no periodic refresh, so what is visible when is decided by the store alone
    writer = make_test_store(server.url, request, refresh_interval="-1")
    reader = ElasticsearchEventStore(hosts=server.url, index_prefix=writer.prefix, manage_template=False)
    request.addfinalizer(reader.close)
    writer.put([ev("a", "gradient explosion")])
    assert reader.get("p", "a") is None                  # written and durable, not yet refreshed
    assert [h.event.event_id for h in writer.search("p", "gradient").items] == ["a"]  # refreshes first
    assert reader.get("p", "a") is not None


def test_prefix_search_normalises_non_ascii_words_as_the_index_does(server: NoidaElasticsearch,
                                                                    request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request)
    store.put([ev("a", "Große Straße failed"), ev("b", "Øresund link down")])
    assert [h.event.event_id for h in store.search("p", "STRAß*").items] == ["a"]   # ß → ss
    assert [h.event.event_id for h in store.search("p", "øre*").items] == ["b"]     # ø → o
    assert [h.event.event_id for h in store.search("p", "ORE*").items] == ["b"]


def test_a_giant_token_is_cut_not_refused(server: NoidaElasticsearch, request: pytest.FixtureRequest) -> None:
    store = make_test_store(server.url, request)
    blob = "QUJD" * 20_000  # 80k characters without a separator: one token
    assert store.put([ev("blob", f"payload {blob} ends")]) == 1
    assert [h.event.event_id for h in store.search("p", f"payload {blob[:50]}*").items] == ["blob"]


def test_index_prefix_is_validated(server: NoidaElasticsearch) -> None:
    for bad in ("", "Upper", "has space", "-lead", "a*b", "a,b"):
        with pytest.raises(ValueError, match="index_prefix"):
            ElasticsearchEventStore(hosts=server.url, index_prefix=bad)
