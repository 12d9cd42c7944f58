"""Issue 18, finding 11: run ids containing ``/`` were accepted and listed, but every per-run endpoint answered
404 (``/api/v1/runs/a/b`` is another path; ``%2F`` is decoded before routing). Such ids -- and ``.``/``..``,
which clients drop as dot-segments -- are now refused at ingest with ``invalid_field`` naming ``run_id``, the
same over HTTP and gRPC; the other events of the batch are kept. Against ``trainguard serve`` (EmbeddedServer:
uvicorn and gRPC on 127.0.0.1, SQLite stores, processor)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List
from urllib.parse import quote

import grpc
import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server
from trainguard import wire
from trainguard.v1 import ingest_pb2, ingest_pb2_grpc

BAD_IDS = ["team/run-1", "/", "a/", "..", "."]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("data")) as server:
        yield server


def _expected(index: int, bad: Dict[str, Any]) -> Dict[str, Any]:
    shown = '"' + bad["run_id"] + '"'
    return {"index": index, "event_id": bad["event_id"], "code": "invalid_field",
            "message": f"events[{index}].run_id: {shown} cannot be a run id: it must be one URL path segment "
                       f"(no '/', not '.' or '..')"}


def _listed_runs(live: LiveServer) -> List[str]:
    r = live.get("/api/v1/runs", limit=500)
    assert r.status_code == 200, r.text
    return [run["run_id"] for run in r.json()["items"]]


@pytest.mark.parametrize("run_id", BAD_IDS)
def test_http_ingest_refuses_a_run_id_that_is_not_one_path_segment(live: LiveServer, run_id: str) -> None:
    good, bad = event("http-good"), event(run_id)
    r = live.post_events([good, bad])
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 1, "duplicates": 0, "rejected": [_expected(1, bad)]}  # was accepted: 2
    live.wait_for(lambda: "http-good" in _listed_runs(live))
    assert run_id not in _listed_runs(live)
    # the run that was kept answers on its per-run endpoints
    assert live.get("/api/v1/runs/http-good").status_code == 200


@pytest.mark.parametrize("run_id", BAD_IDS)
def test_grpc_ingest_refuses_the_same_run_ids(live: LiveServer, run_id: str) -> None:
    good, bad = event("grpc-good"), event(run_id)
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = ingest_pb2_grpc.IngestServiceStub(channel)
        metadata = (("authorization", f"Bearer {live.ingest_token}"),)
        response = stub.Send(wire.ingest_request_from_dicts([good, bad]), metadata=metadata, timeout=10)
        assert response.accepted == 1
        assert [{"index": x.index, "event_id": x.event_id, "code": x.code, "message": x.message}
                for x in response.rejected] == [_expected(1, bad)]
        streamed = stub.Stream(iter([ingest_pb2.IngestRequest(events=[wire.envelope_from_dict(event(run_id))])]),
                               metadata=metadata, timeout=10)
        assert (streamed.accepted, [x.code for x in streamed.rejected]) == (0, ["invalid_field"])
    live.wait_for(lambda: "grpc-good" in _listed_runs(live))
    assert run_id not in _listed_runs(live)


def test_run_ids_with_other_url_characters_still_work_end_to_end(live: LiveServer) -> None:
    """Only '/' and dot-segments are refused: other characters are percent-encoded by clients and work."""
    run_id = "exp 7?x=1#frag%2F:@"
    r = live.post_events([event(run_id, step=s) for s in range(3)])
    assert (r.status_code, r.json()["accepted"]) == (200, 3)
    live.wait_for(lambda: run_id in _listed_runs(live))
    r = live.get(f"/api/v1/runs/{quote(run_id, safe='')}")
    assert (r.status_code, r.json()["run_id"]) == (200, run_id)
    r = live.get(f"/api/v1/runs/{quote(run_id, safe='')}/metrics/summary")
    assert r.status_code == 200 and [m["name"] for m in r.json()] == ["loss"]
