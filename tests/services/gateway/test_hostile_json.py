"""Hostile JSON bodies against ``trainguard serve`` (EmbeddedServer: uvicorn on 127.0.0.1, SQLite stores,
processor). A key given twice was decoded silently, the last one winning: ``{"events": [...], "events": []}``
acknowledged nothing of the first array without a word, and an event could carry two ``event_id`` or
``project`` values that a proxy and the server read differently. A number of 5,000 digits was refused with
Python's advice to call ``sys.set_int_max_str_digits()``. Now both are a 400 saying what is wrong, and the
next good batch is stored."""

from __future__ import annotations

import gzip
import json
from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _post(live: LiveServer, body: bytes) -> tuple[int, dict]:
    r = live.client.post("/v1/ingest", content=body, headers={
        "Authorization": f"Bearer {live.ingest_token}", "Content-Type": "application/json"})
    return r.status_code, r.json()


def _then_a_good_batch_is_stored(live: LiveServer, run_id: str) -> None:
    r = live.post_events([event(run_id)])
    assert r.json()["accepted"] == 1
    live.wait_for(lambda: live.get(f"/api/v1/runs/{run_id}").status_code == 200)


def _one_event(run_id: str) -> str:
    return json.dumps(event(run_id))


def test_events_given_twice_is_refused_not_half_dropped(live: LiveServer) -> None:
    body = f'{{"events": [{_one_event("dup-first")}], "events": [{_one_event("dup-second")}]}}'.encode()
    assert _post(live, body) == (400, {"detail": 'malformed JSON: duplicate key "events" in one object (each '
                                                 'field may be given once)'})  # was 200, accepted 1 (the second)
    _then_a_good_batch_is_stored(live, "after-dup-events")
    assert live.get("/api/v1/runs/dup-second").status_code == 404


@pytest.mark.parametrize("key,first,second", [("event_id", "aaaa", "bbbb"), ("project", "default", "other"),
                                              ("run_id", "dup-a", "dup-b")])
def test_a_field_given_twice_in_an_event_is_refused(live: LiveServer, key: str, first: str, second: str) -> None:
    one = event("dup-field")
    one.pop(key, None)
    text = json.dumps(one)[:-1] + f', "{key}": "{first}", "{key}": "{second}"}}'
    status, body = _post(live, f'{{"events": [{text}]}}'.encode())
    assert (status, body) == (400, {"detail": f'malformed JSON: duplicate key "{key}" in one object (each '
                                              f'field may be given once)'})  # was 200, the second value kept
    _then_a_good_batch_is_stored(live, f"after-dup-{key}")


def test_a_duplicate_inside_a_point_is_refused_too(live: LiveServer) -> None:
    text = _one_event("dup-point").replace('"value": ', '"value": 1.0, "value": ', 1)
    assert _post(live, f'{{"events": [{text}]}}'.encode())[1] == {
        "detail": 'malformed JSON: duplicate key "value" in one object (each field may be given once)'}


def test_a_deeply_nested_body_with_events_twice_is_refused(live: LiveServer) -> None:
    """The event-by-event decoder (bodies nested past ~1,000 levels) refuses ``events`` twice as well."""
    deep = '{"a":' * 3000 + "1" + "}" * 3000
    body = f'{{"events": [{deep}], "events": [{_one_event("deep-dup")}]}}'.encode()
    assert _post(live, body) == (400, {"detail": 'malformed JSON: duplicate key "events" in one object (each '
                                                 'field may be given once)'})


def test_a_number_of_5000_digits_is_named_as_such(live: LiveServer) -> None:
    text = _one_event("many-digits").replace('"step": 0', '"step": ' + "9" * 5000, 1)
    assert _post(live, f'{{"events": [{text}]}}'.encode()) == (400, {
        "detail": "malformed JSON: a number of 5000 digits is longer than the 4300 digits a JSON number may "
                  "have here (an int64 has at most 19)"})  # was: "... use sys.set_int_max_str_digits() ..."
    _then_a_good_batch_is_stored(live, "after-digits")


def test_bytes_after_a_gzip_stream_are_named_as_such(live: LiveServer) -> None:
    body = gzip.compress(json.dumps({"events": [event("gzip-tail")]}).encode())
    r = live.client.post("/v1/ingest", content=body + b"garbage", headers={
        "Authorization": f"Bearer {live.ingest_token}", "Content-Type": "application/json",
        "Content-Encoding": "gzip"})
    assert (r.status_code, r.json()) == (400, {"detail": (  # was "... incorrect header check" alone
        f"malformed gzip body: the data after gzip member 1 (from byte {len(body)}) is not gzip (Error -3 while "
        f"decompressing data: incorrect header check)")})
