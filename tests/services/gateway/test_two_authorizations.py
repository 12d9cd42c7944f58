"""A request with two ``Authorization`` values (two HTTP headers, two gRPC ``authorization`` metadata
entries): the gateway and the query API used the first and ignored the rest, so a proxy that checks the last
one and the server could disagree on whose request it is. Now it is refused as unauthenticated, saying how
many were sent; one value works as before. Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

import json
from typing import Iterator, List, Tuple

import grpc
import httpx
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard import wire
from trainguard.v1 import ingest_pb2_grpc


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _headers(*tokens: str) -> List[Tuple[str, str]]:
    return [("Content-Type", "application/json")] + [("Authorization", f"Bearer {t}") for t in tokens]


def test_http_ingest_refuses_two_authorization_headers(live: LiveServer) -> None:
    body = json.dumps({"events": [event("two-auth")]}).encode()
    r = live.client.post("/v1/ingest", content=body,
                         headers=httpx.Headers(_headers(live.ingest_token, live.read_token)))
    assert (r.status_code, r.json()) == (401, {"detail": "2 Authorization values were sent; send exactly one "
                                                         "'Bearer <ingest token>'"})  # was 200
    assert r.headers["www-authenticate"] == "Bearer"
    one = live.client.post("/v1/ingest", content=body, headers=httpx.Headers(_headers(live.ingest_token)))
    assert one.json()["accepted"] == 1


def test_grpc_refuses_two_authorization_entries(live: LiveServer) -> None:
    request = wire.ingest_request_from_dicts([event("two-auth-grpc")])
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Send(request, timeout=10, metadata=(("authorization", f"Bearer {live.ingest_token}"),
                                                     ("authorization", f"Bearer {live.ingest_token}")))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused.value.details() == "2 Authorization values were sent; send exactly one 'Bearer <ingest token>'"
        assert stub.Send(request, timeout=10,
                         metadata=(("authorization", f"Bearer {live.ingest_token}"),)).accepted == 1


def test_the_query_api_refuses_two_authorization_headers(live: LiveServer) -> None:
    r = live.client.get("/api/v1/runs", headers=httpx.Headers(_headers(live.read_token, live.read_token)))
    assert (r.status_code, r.json()) == (401, {"detail": "2 Authorization headers were sent; send exactly one "
                                                         "'Bearer <read token>'"})  # was 200
    assert live.get("/api/v1/runs").status_code == 200
