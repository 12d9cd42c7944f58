"""``trainguard serve`` in the test process, for the issue-18 gateway and API tests: the real EmbeddedServer
(SQLite stores and queue, processor, uvicorn HTTP on 127.0.0.1, gRPC) on ephemeral ports, with its bootstrap
tokens and small helpers to ingest and read."""

from __future__ import annotations

import json
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional
from urllib.parse import urlparse

import httpx
import pytest

from trainguard_server.config import Settings
from trainguard_server.server import EmbeddedServer


class LiveServer:
    """A started EmbeddedServer; ``client`` talks HTTP to it; ``ingest``/``read`` are its bootstrap tokens."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        assert server.tokens is not None
        self.ingest_token, self.read_token = server.tokens.ingest, server.tokens.read
        self.url = server.http_url
        self.grpc_target = f"127.0.0.1:{server.grpc_port}"
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def read_headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.read_token}"}

    def post_events(self, events: List[Dict[str, Any]]) -> httpx.Response:
        return self.client.post("/v1/ingest", content=json.dumps({"events": events}).encode(), headers={
            "Authorization": f"Bearer {self.ingest_token}", "Content-Type": "application/json"})

    def get(self, path: str, **params: Any) -> httpx.Response:
        return self.client.get(path, params=params or None, headers=self.read_headers)

    def grpc_send(self, events: List[Dict[str, Any]]) -> Any:
        """One gRPC ``Send`` of ``events`` (JSON mappings) with the ingest token: its ``IngestResponse``."""
        import grpc

        from trainguard import wire
        from trainguard.v1 import ingest_pb2_grpc
        with grpc.insecure_channel(self.grpc_target) as channel:
            return ingest_pb2_grpc.IngestServiceStub(channel).Send(
                wire.ingest_request_from_dicts(events), timeout=10,
                metadata=(("authorization", f"Bearer {self.ingest_token}"),))

    def run_ids(self) -> List[str]:
        """The ids of the bootstrap project's runs (at most 500), as the query API lists them."""
        r = self.get("/api/v1/runs", limit=500)
        assert r.status_code == 200, r.text
        return [run["run_id"] for run in r.json()["items"]]

    def wait_for(self, check: Callable[[], bool], timeout: float = 20.0) -> None:
        """Poll ``check`` until it is true (the processor works asynchronously)."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError("condition not met in time")
            time.sleep(0.05)


def event(run_id: str, step: int = 0, **fields: Any) -> Dict[str, Any]:
    """A metrics envelope (JSON mapping) for ``run_id`` at the current time."""
    out: Dict[str, Any] = {"event_id": uuid.uuid4().hex, "run_id": run_id, "step": step,
                           "time_unix_nano": time.time_ns(), "severity": "INFO",
                           "metrics": {"points": [{"name": "loss", "value": 2.0 / (step + 1)}]}}
    out.update(fields)
    return out


@contextmanager
def live_server(data_dir: Path, **settings: Any) -> Iterator[LiveServer]:
    values: Dict[str, Any] = dict(data_dir=data_dir, host="127.0.0.1", http_port=0, grpc_port=0,
                                  snapshot_every_s=0.5, tick_interval_s=0.2)
    values.update(settings)
    server = EmbeddedServer(Settings(**values))
    server.start()
    live: Optional[LiveServer] = None
    try:
        live = LiveServer(server)
        yield live
    finally:
        if live is not None:
            live.client.close()
        server.stop(drain=False)


def module_live_server(**settings: Any) -> Any:
    """A module-scoped pytest fixture serving a :func:`live_server` with ``settings``: ``live = module_live_server()``
    in a test module."""
    @pytest.fixture(scope="module")
    def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
        with live_server(tmp_path_factory.mktemp("data"), **settings) as server:
            yield server
    return live


def raw_exchange(live: LiveServer, data: bytes) -> bytes:
    """Send ``data`` as is over one TCP connection to the live server and read until it closes the
    connection (for requests no HTTP client would send, e.g. two framings)."""
    url = urlparse(live.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
        return out


def read_answer(conn: socket.socket) -> bytes:
    """One HTTP answer read from a raw socket: its head and as many body bytes as its Content-Length says (less
    when the server closes first)."""
    out = b""
    while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _content_length(out):
        chunk = conn.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


def _content_length(out: bytes) -> int:
    for line in out.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0
