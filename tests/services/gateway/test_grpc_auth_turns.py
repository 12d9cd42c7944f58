"""The gRPC servicer's memory of tokens seen to pass (security.md H45): which turn of the workers a token's
check is queued in. Before stop 45 the table was cleared whole at ``AUTH_KEYS_MAX`` entries, so one tenant
authenticating that many distinct valid tokens sent every other tenant's next check back into the turn all
unknown tokens share (behind every bad token queued there, H41). Now a full table forgets the least recently
used token of the project holding the most."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any, Iterator, List, Tuple

import pytest

from tests.services.gateway.helpers import new_gateway
from trainguard_server.gateway import grpc as grpc_gateway
from trainguard_server.gateway.grpc import _AUTH, _TokenTurns, build_grpc_server

MiB = 2**20
SIZE = 32  # the table's bound in these tests (AUTH_KEYS_MAX, 4,096 by default)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Any, Any]]:
    monkeypatch.setattr(grpc_gateway, "AUTH_KEYS_MAX", SIZE)
    gateway, _queue, _tokens = new_gateway(max_batch_bytes=MiB, max_event_bytes=MiB // 2)
    server, _port = build_grpc_server(gateway, "127.0.0.1", 0, MiB, workers=1)
    server.start()
    try:
        yield gateway, server
    finally:
        server.stop(None).wait(10)


class _Context:
    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def invocation_metadata(self) -> Any:
        return self.metadata


def _authenticate(server: Any, token: str) -> futures.Future[Any]:
    return asyncio.run_coroutine_threadsafe(server.servicer._authenticate(_Context(token)), server._loop)


def _turns(server: Any, n: int = 50) -> None:
    async def spin() -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    server._call(spin())


def _key(server: Any, token: str) -> str:
    async def key() -> str:
        return str(server.servicer._auth_key(token))

    return str(server._call(key()))


def test_a_flood_of_one_projects_distinct_tokens_leaves_another_projects_check_in_its_own_turn(
        served: Any) -> None:
    gateway, server = served
    checked: List[str] = []
    authenticate = gateway.authenticate

    def spy(token: Any) -> Any:
        checked.append(token)
        return authenticate(token)

    gateway.authenticate = spy
    quiet = str(gateway.projects.create_token("quiet", "ingest"))
    assert _authenticate(server, quiet).result(30).project == "quiet"  # passes once: remembered
    assert _key(server, quiet) == _AUTH + "quiet"
    noisy = [str(gateway.projects.create_token("noisy", "ingest")) for _ in range(3 * SIZE)]
    for token in noisy:  # the flood: every one valid, each distinct
        assert _authenticate(server, token).result(30).project == "noisy"
    assert _key(server, quiet) == _AUTH + "quiet"  # was: _AUTH (the table cleared at SIZE)
    assert len(server.servicer._auth_keys) <= SIZE
    assert _key(server, noisy[-1]) == _AUTH + "noisy"  # the flood's latest are remembered
    # the check's place: the one worker busy, 30 bad tokens queued in the shared turn, then quiet's
    checked.clear()
    release = threading.Event()
    blocker = server.servicer.work.submit("X", lambda: release.wait(30))
    bad = quiet[:-6] + "xxxxxx"
    calls = [_authenticate(server, bad) for _ in range(30)]
    _turns(server)
    calls.append(_authenticate(server, quiet))
    _turns(server)
    release.set()
    blocker.result(30)
    assert calls[-1].result(30).project == "quiet"
    for call in calls[:-1]:
        with pytest.raises(Exception, match="invalid or revoked token"):
            call.result(30)
    assert len(checked) == 31
    assert checked.index(quiet) <= 2, checked.index(quiet)  # its own turn (was: 31st, behind every bad one)


def test_the_table_forgets_the_largest_projects_least_recently_used_token() -> None:
    turns = _TokenTurns(4)
    turns.put("a1", "a")
    turns.put("b1", "b")
    turns.put("b2", "b")
    turns.put("b3", "b")
    assert turns.get("b1") == "b"  # b1 used again: b2 is now b's least recently used
    turns.put("b4", "b")  # full: b holds the most
    assert [turns.get(t) for t in ("a1", "b1", "b2", "b3", "b4")] == ["a", "b", None, "b", "b"]
    turns.put("c1", "c")  # full again: b's least recently used (b1, after the gets above)
    assert turns.get("b1") is None and len(turns) == 4
    assert [turns.get(t) for t in ("a1", "b3", "b4", "c1")] == ["a", "b", "b", "c"]
    turns.put("c2", "c")  # b holds 2: b3
    assert turns.get("b3") is None and turns.get("b4") == "b" and turns.get("a1") == "a"
    turns.put("c3", "c")  # c holds 2 now: its own c1 goes
    assert turns.get("c1") is None and turns.get("c2") == "c" and turns.get("c3") == "c"
    turns.put("a1", "c")  # the same text now of another project: one entry, moved
    assert turns.get("a1") == "c" and len(turns) == 4


def test_a_tie_forgets_a_token_of_the_project_used_least_recently() -> None:
    turns = _TokenTurns(2)
    turns.put("x1", "x")
    turns.put("y1", "y")
    assert turns.get("x1") == "x"  # x used last
    turns.put("z1", "z")
    assert (turns.get("x1"), turns.get("y1"), turns.get("z1")) == ("x", None, "z")
