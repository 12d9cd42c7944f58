"""gRPC connections are file descriptors of the process HTTP, the stores and the queue share (security.md H38).
Before stop 43 a connection that sent the HTTP/2 preface and no call was held for ever (one that sent nothing
for 120 s), and nothing bounded how many: 900 such connections, no token needed, against an open-files limit
of 800 left every tenant's HTTP ingest timing out for as long as they were held. Now one with no call for
``grpc_stream_idle_timeout_s`` is closed, so is one that does not complete its handshake within
``http_header_timeout_s``, and at most ``max_connections()`` (half the open-files limit) are open at once."""

from __future__ import annotations

import socket
import time
from typing import Any, Iterator, List

import pytest

from tests.services.gateway.helpers import new_gateway
from trainguard_server.gateway import grpc as grpc_gateway

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (reading and dropping what it sends)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except socket.timeout:
            return False
        except OSError:
            return True
    return False


def _served(sock: socket.socket, within_s: float) -> bool:
    """Whether the server answers ``sock``'s preface (its SETTINGS frame) within ``within_s``: it has
    accepted the connection and counts it (no sleep standing in for that on a slow machine)."""
    sock.settimeout(within_s)
    try:
        return bool(sock.recv(65536))
    except OSError:
        return False


@pytest.fixture(params=[1.0, 120.0], ids=["short-timeouts", "long-timeouts"])
def port(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(grpc_gateway, "max_connections", lambda settings: 3, raising=False)
    timeout = request.param
    gateway, _queue, _tokens = new_gateway(grpc_stream_idle_timeout_s=timeout, http_header_timeout_s=timeout)
    server, bound = grpc_gateway.build_grpc_server(gateway, "127.0.0.1", 0, 2**20)
    server.start()
    try:
        yield bound
    finally:
        server.stop(None).wait(10)


@pytest.mark.parametrize("port", [1.0], indirect=True)
def test_idle_and_handshakeless_connections_are_closed(port: int) -> None:
    idle = socket.create_connection(("127.0.0.1", port))
    idle.sendall(PREFACE)  # then no call
    silent = socket.create_connection(("127.0.0.1", port))  # not even the preface
    try:
        assert _closed_by_server(idle, 30), "a connection with no call was held (was: for ever)"
        assert _closed_by_server(silent, 30), "a connection with no handshake was held (was: 120 s)"
    finally:
        idle.close()
        silent.close()


@pytest.mark.parametrize("port", [120.0], indirect=True)
def test_connections_past_max_connections_are_closed_at_once(port: int) -> None:
    held: List[socket.socket] = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(PREFACE)
            held.append(sock)
            assert _served(sock, 30), "one of the first three connections was not served"
        extra = socket.create_connection(("127.0.0.1", port))
        held.append(extra)
        extra.sendall(PREFACE)
        assert _closed_by_server(extra, 30), "a fourth connection was accepted past max_connections() = 3"
        assert not any(_closed_by_server(sock, 0.2) for sock in held[:3])  # the first three are served
    finally:
        for sock in held:
            sock.close()


def test_max_connections_defaults_to_half_the_open_files_limit() -> None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    settings: Any = type("S", (), {"grpc_max_connections": 0})()
    assert grpc_gateway.max_connections(settings) == max(64, soft // 2)
    settings.grpc_max_connections = 10
    assert grpc_gateway.max_connections(settings) == 10
