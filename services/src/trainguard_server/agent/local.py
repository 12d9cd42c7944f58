"""The agent's loopback listeners: HTTP (ingest, ``/healthz``, ``/v1/agent/status``) and gRPC ingest.

Both adapters are the platform gateway's own (:func:`~trainguard_server.gateway.http.ingest_router`,
:func:`~trainguard_server.gateway.grpc.build_grpc_server`) over the relay's gateway.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import grpc
from fastapi import FastAPI

from ..gateway.grpc import build_grpc_server
from ..gateway.http import ingest_router
from ..gateway.ingest import Gateway
from ..http_thread import HttpThread


def split_address(value: str, default_port: int) -> Tuple[str, int]:
    """``host:port`` / ``:port`` / ``port`` / ``[v6]:port`` → (host, port); host defaults to 127.0.0.1."""
    value = value.strip()
    if value.isdigit():
        return "127.0.0.1", int(value)
    host, _, port = value.rpartition(":")
    if not _:
        return value or "127.0.0.1", default_port
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port) if port else default_port


class LocalServers:
    """Starts and stops the listeners; ``http_port`` / ``grpc_port`` are the bound ports (0: off)."""

    def __init__(self, gateway: Gateway, status: Callable[[], Dict[str, Any]]) -> None:
        self.gateway = gateway
        self.status = status
        self.http_port = 0
        self.grpc_port = 0
        self._http: Optional[HttpThread] = None
        self._grpc: Optional[grpc.Server] = None

    def start_http(self, address: str) -> int:
        host, port = split_address(address, 4318)
        app = FastAPI(title="trainguard agent", docs_url=None, redoc_url=None, openapi_url=None)
        app.include_router(ingest_router(self.gateway))
        status = self.status

        @app.get("/healthz")
        def healthz() -> Dict[str, Any]:
            return {"status": "ok"}

        @app.get("/v1/agent/status")
        def agent_status() -> Dict[str, Any]:
            return status()

        self._http = HttpThread(app, host, port, "trainguard-agent-http")
        self.http_port = self._http.port
        self._http.start()
        return self.http_port

    def start_grpc(self, address: str) -> int:
        host, port = split_address(address, 4317)
        self._grpc, self.grpc_port = build_grpc_server(self.gateway, host, port,
                                                       max_message_bytes=self.gateway.settings.max_batch_bytes,
                                                       workers=4)
        self._grpc.start()
        return self.grpc_port

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait(2.0)
            self._grpc = None
        if self._http is not None:
            self._http.stop(5)
            self._http = None
