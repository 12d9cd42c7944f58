"""Fuzz: the HTTP ingest decoder and validation (gateway/ingest.py ``batch_from_json``, gateway/validate.py,
``gunzip``) on arbitrary input, through the real Gateway over a MemoryQueue.

Contract under test (gateway/ingest.py, docs/wire-format.md): whatever the body, decoding and ingesting it
either raises a :class:`GatewayError` (a whole-request 4xx: InvalidRequest, RequestTooLarge) or returns a
per-item result in which every event the client sent is accounted for exactly once -- accepted, duplicate or
rejected with one of validate.CODES and a message naming ``events[i]`` -- and what was queued is exactly the
accepted events, each a valid envelope under its run's key. Any other exception is a bug (HTTP 500).
"""

from __future__ import annotations

import gzip
import http.client
import json
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fuzz.budget import examples
from tests.fuzz.strategies import deep_json_text, envelope_dicts, json_values
from tests.services.gateway.helpers import NOW_NS, UvicornThread, drain, metric_event, new_gateway
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_server.gateway.http import gunzip, ingest_router
from trainguard_server.gateway.ingest import Batch, GatewayError, IngestResult, batch_from_json
from trainguard_server.gateway.validate import CODES, Limits, validate_envelope

# per test, full / ci profile (tests/fuzz/budget.py): the ci counts keep the file near 20 s on the 2-core CI
# machine; TRAINGUARD_FUZZ_PROFILE=full runs 400 / 300
EXAMPLES = examples(400, ci=150)
SERVER_EXAMPLES = examples(300, ci=100)  # over HTTP
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GATEWAY, QUEUE, TOKENS = new_gateway()
AUTH = GATEWAY.authenticate(TOKENS.ingest)
MAX_EVENTS = GATEWAY.settings.max_batch_events
TRIED: Dict[str, int] = {}
OUTCOMES: Counter[str] = Counter()  # requests refused whole, events accepted, events rejected by code


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    """Print the examples each fuzz test of this file tried (the issue-18 note quotes them)."""
    yield
    print(f"\nHTTP decoder fuzz, examples per test: {TRIED}; outcomes: {dict(sorted(OUTCOMES.items()))}")


def _count(test: str) -> None:
    TRIED[test] = TRIED.get(test, 0) + 1


def _ingest(body: bytes, *, gzipped: bool = False) -> Optional[IngestResult]:
    """What POST /v1/ingest does with ``body`` after auth: None for a documented whole-request error."""
    try:
        if gzipped:
            body = gunzip(body, GATEWAY.settings.max_batch_bytes, max_members=GATEWAY.settings.max_gzip_members)
        batch = batch_from_json(body, max_events=MAX_EVENTS)
        _check_batch(batch)
        result = GATEWAY.ingest_batch(AUTH, batch)
    except GatewayError as exc:
        assert not drain(QUEUE), "a refused request queued events"
        OUTCOMES[f"refused:{type(exc).__name__}"] += 1
        return None
    _check_result(batch, result)
    OUTCOMES["accepted"] += result.accepted
    OUTCOMES["duplicates"] += result.duplicates
    OUTCOMES.update(f"rejected:{r.code}" for r in result.rejected)
    return result


def _check_batch(batch: Batch) -> None:
    decoded = len(batch.request.events)
    assert batch.count == decoded + len(batch.rejected)
    if batch.indices is not None:
        assert len(batch.indices) == decoded
    for item in batch.rejected:
        assert item.code == "invalid_field", item
        assert item.message.startswith(f"events[{item.index}]"), item


def _check_result(batch: Batch, result: IngestResult) -> None:
    indices = [r.index for r in result.rejected]
    assert indices == sorted(set(indices)), indices
    assert all(0 <= i < batch.count for i in indices), indices
    assert result.accepted + result.duplicates + len(result.rejected) == batch.count, (result, batch.count)
    for item in result.rejected:
        assert item.code in CODES, item
        assert item.message.startswith(f"events[{item.index}]"), item
    queued = drain(QUEUE)
    assert len(queued) == result.accepted
    limits = Limits.from_settings(GATEWAY.settings)
    for key, envelope in queued:
        assert envelope.run_id == key
        assert envelope.project == AUTH.project
        assert validate_envelope(envelope, project=AUTH.project, now_ns=NOW_NS, limits=limits) is None
    result.to_json()  # the 200 body serialises


def _body(doc: Any, ascii: bool = True) -> bytes:
    """``doc`` as JSON text; ``ascii``: non-ASCII as \\u escapes (lone surrogates too, which then reach the
    envelope converter), else as UTF-8 (a lone surrogate makes the body invalid UTF-8)."""
    return json.dumps(doc, ensure_ascii=ascii).encode("utf-8", "surrogatepass")


@FUZZ
@given(json_values(max_leaves=30), st.booleans())
@example(float("nan"), True)
@example({"events": [{"event_id": "a", "run_id": "r", "step": 2**64, "metrics": {}}]}, True)
@example({"events": [{"event_id": "a", "run_id": "r", "rank": -(2**70), "metrics": {}}]}, True)
@example({"events": [{"event_id": "a", "run_id": "\udc80", "metrics": {}}]}, True)
def test_any_json_body(doc: Any, ascii: bool) -> None:
    """Any JSON document as the body (NaN/Infinity tokens included: json.dumps writes them)."""
    _count("any_json_body")
    _ingest(_body(doc, ascii))


@FUZZ
@given(st.lists(st.one_of(envelope_dicts(wild=0.15), json_values(finite=True)), max_size=8), st.booleans())
def test_events_with_wrong_types(events: List[Any], ascii: bool) -> None:
    """Envelopes from the wire schema with some fields of the wrong type, and arbitrary values as events."""
    _count("events_with_wrong_types")
    result = _ingest(_body({"events": events}, ascii))
    assert result is not None, "a body with an events array is never refused whole"


@FUZZ
@given(st.lists(envelope_dicts(), min_size=1, max_size=6), st.data())
def test_schema_envelopes_with_a_deep_field(events: List[Dict[str, Any]], data: st.DataObject) -> None:
    """Envelopes from the wire schema, one of which has a field nested > 1,000 levels (the deep_json path): that
    event alone is rejected; the others get the verdict they get without it."""
    _count("schema_envelopes_with_a_deep_field")
    i = data.draw(st.integers(0, len(events) - 1))
    field = data.draw(st.sampled_from(["tags", "metrics", "run_id", "extra"]))
    marker = '"deep-value-marker"'
    text = json.dumps({"events": [*events[:i], dict(events[i], **{field: json.loads(marker)}),
                                  *events[i + 1:]]})
    baseline = _ingest(_body({"events": events[:i] + events[i + 1:]}))
    result = _ingest(text.replace(marker, data.draw(deep_json_text())).encode())
    assert result is not None and baseline is not None
    rejected = {r.index: r for r in result.rejected}
    assert rejected[i].code == "invalid_field" and "too deep" in rejected[i].message, rejected[i]
    assert result.accepted == baseline.accepted


@FUZZ
@given(st.one_of(st.binary(max_size=300),
                 st.binary(max_size=200).map(lambda b: b'{"events": [' + b),
                 st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
                 st.integers(0, 4000).map(lambda n: b'{"events": [' + b"[" * n)))
def test_arbitrary_bytes(body: bytes) -> None:
    """Bytes that are not JSON, not UTF-8, truncated, or unterminated nesting."""
    _count("arbitrary_bytes")
    _ingest(body)


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 st.lists(st.sampled_from([b"", b"{}", b'{"events": []}']), min_size=1, max_size=40)
                 .map(lambda parts: b"".join(gzip.compress(p) for p in parts)),
                 st.tuples(st.binary(max_size=64), st.integers(0, 64))
                 .map(lambda t: gzip.compress(_body({"events": [metric_event()]}))[: t[1]] + t[0])))
def test_gzip_bodies(body: bytes) -> None:
    """gzip-encoded bodies: garbage, many members, truncated or trailing bytes."""
    _count("gzip_bodies")
    _ingest(body, gzipped=True)



# ---------------------------------------------------------------------------------------- real server

#: what POST /v1/ingest may answer (gateway/http.py's table, the served OpenAPI); 429/503 need a full queue
DOCUMENTED = {200, 400, 401, 403, 413, 415}


@pytest.fixture(scope="module")
def ingest_server() -> Iterator[str]:
    """``host:port`` of a real uvicorn server with the ingest router over this file's gateway."""
    app = FastAPI()
    app.include_router(ingest_router(GATEWAY))
    with UvicornThread(app) as uv:
        yield f"127.0.0.1:{uv.port}"


def _post(target: str, headers: Dict[str, str], body: bytes) -> Tuple[int, str, bytes]:
    """POST /v1/ingest with exactly these headers (http.client sends what httpx would refuse to); status 0
    when the server reset the connection."""
    connection = http.client.HTTPConnection(target, timeout=20)
    try:
        connection.putrequest("POST", "/v1/ingest", skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        if "Content-Length" not in headers:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    except ConnectionError:
        return 0, "", b""
    finally:
        connection.close()


_HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)


@st.composite
def _requests(draw: Any) -> Dict[str, Any]:
    """Headers and a body as a client could send them: any Content-Type / Content-Encoding /
    Authorization / Content-Length spelling, a body that is JSON, protobuf, gzip or garbage."""
    body = draw(st.one_of(
        st.lists(st.one_of(envelope_dicts(wild=0.1), json_values(finite=True)), max_size=5)
        .map(lambda events: _body({"events": events})),
        json_values(max_leaves=20).map(_body),
        st.lists(envelope_dicts(), max_size=4).map(
            lambda events: bytes(wire.prepare_batch(events).request.SerializeToString())),
        st.binary(max_size=200)))
    encoding = draw(st.sampled_from([None, "gzip", "x-gzip", "identity", "GZIP", "br", "gzip, gzip", ""]))
    if encoding and "gzip" in encoding.lower() and draw(st.booleans()):
        body = gzip.compress(body)
    headers = {"Content-Type": draw(st.one_of(st.sampled_from([
        "application/json", "application/x-protobuf", "application/protobuf", "application/json; charset=utf-8",
        "APPLICATION/JSON", "text/plain", "", "multipart/form-data; boundary=x"]), _HEADER_TEXT))}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    token = draw(st.sampled_from(["ingest"] * 4 + ["read", "revoked", "none", "scheme", "empty", "text"]))
    auth = {"ingest": f"Bearer {TOKENS.ingest}", "read": f"Bearer {TOKENS.read}",
            "revoked": f"Bearer {TOKENS.revoked}", "scheme": f"Basic {TOKENS.ingest}", "empty": "Bearer ",
            "text": draw(_HEADER_TEXT), "none": None}[token]
    if auth is not None:
        headers["Authorization"] = auth
    if draw(st.sampled_from([False] * 19 + [True])):  # a malformed or huge Content-Length, 1 in 20
        headers["Content-Length"] = draw(st.sampled_from(["abc", "-1", str(len(body) + 10**12), "1e3"]))
    return {"headers": headers, "content": body}


@settings(FUZZ, max_examples=SERVER_EXAMPLES)
@given(_requests())
def test_any_request_over_http(ingest_server: str, request: Dict[str, Any]) -> None:
    """A real uvicorn server answers only documented statuses, errors as JSON {"detail": str} -- except a
    request whose Content-Length is not a number, which uvicorn itself refuses (400) before the app."""
    _count("any_request_over_http")
    headers = request["headers"]
    status, content_type, body = _post(ingest_server, headers, request["content"])
    OUTCOMES[f"http:{status}"] += 1
    if not headers.get("Content-Length", "0").isdigit():  # refused by uvicorn (400) or the app (400/401/413)
        assert status in (0, 400, 401, 413), (status, body)  # 0: it closed the connection on the unread body
        assert not drain(QUEUE)
        return
    assert status in DOCUMENTED, (status, body)
    if status != 200:
        assert content_type == "application/json", (status, content_type, body)
        detail = json.loads(body)["detail"]
        assert isinstance(detail, str) and detail
        assert not drain(QUEUE), "a refused request queued events"
        return
    if content_type.startswith("application/json"):
        result = json.loads(body)
        accepted = result["accepted"]
        assert all(item["code"] in CODES for item in result["rejected"]), result
    else:
        accepted = ingest_pb2.IngestResponse.FromString(body).accepted
    assert len(drain(QUEUE)) == accepted
