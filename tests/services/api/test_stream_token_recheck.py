"""Issue 18, finding 7: a live run stream (server-sent events) opened with a read token must end once that
token is revoked or expires -- before the fix it kept streaming the project's runs and incidents forever.
A real uvicorn server on 127.0.0.1 over SQLite stores."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import ContextManager, Iterator

import httpx
import pytest

from tests.services.api.live_server import PROJECT, LiveApi, sse_messages, take

RECHECK_S = 0.3
#: a read timeout far above the bound under test: a stream that does not end fails with ReadTimeout
READ_TIMEOUT_S = 10.0


@pytest.fixture
def api(tmp_path: Path) -> Iterator[LiveApi]:
    live = LiveApi(tmp_path, api_stream_auth_recheck_s=RECHECK_S)
    yield live
    live.close()


def stream(api: LiveApi, token: str) -> ContextManager[httpx.Response]:
    return httpx.stream("GET", f"{api.url}/api/v1/runs/{api.run.run_id}/stream", params={"interval": 0.2},
                        headers=api.headers(token), timeout=httpx.Timeout(READ_TIMEOUT_S))


def test_a_revoked_tokens_stream_ends_with_an_error(api: LiveApi) -> None:
    doomed = api.stores.projects.create_token(PROJECT, "read")
    info = api.stores.projects.authenticate(doomed)
    assert info is not None
    with stream(api, doomed) as response, stream(api, api.read_token) as kept:
        assert response.status_code == kept.status_code == 200
        messages, kept_messages = sse_messages(response), sse_messages(kept)
        assert [e for e, _ in take(messages, 2)] == ["run", "incidents"]
        assert [e for e, _ in take(kept_messages, 2)] == ["run", "incidents"]
        assert api.stores.projects.revoke(info.token_id)
        # before the fix: nothing more ever came (ReadTimeout); now one error message, then the end
        assert list(messages) == [("error", {"status": 401, "detail": "unknown or revoked token"})]
        # a valid token's stream is untouched: it still gets the run's next change
        api.stores.incidents.upsert_runs([dataclasses.replace(api.run, last_step=42)])
        event, data = next(kept_messages)
        assert (event, data["last_step"]) == ("run", 42)
    # and the revoked token cannot open a new one
    assert httpx.get(f"{api.url}/api/v1/runs/{api.run.run_id}/stream", headers=api.headers(doomed),
                     timeout=READ_TIMEOUT_S).status_code == 401


def test_an_expiring_tokens_stream_ends_when_it_expires(api: LiveApi) -> None:
    expires_ns = time.time_ns() + 1_500_000_000
    short = api.stores.projects.create_token(PROJECT, "read", expires_ns=expires_ns)
    with stream(api, short) as response:
        assert response.status_code == 200
        messages = sse_messages(response)
        assert [e for e, _ in take(messages, 2)] == ["run", "incidents"]
        [(event, data)] = list(messages)  # before the fix: ReadTimeout, the stream outlived its token
    assert time.time_ns() >= expires_ns
    assert event == "error" and data["status"] == 401
    assert data["detail"].startswith("token expired at ") and data["detail"].endswith(": create a new one")
