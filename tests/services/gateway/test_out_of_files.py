"""A token check whose store is out of descriptors (security.md H46): the gateway's answer, over HTTP and gRPC,
in process (the black-box burst is tests/services/test_server_open_files.py). Before stop 45 the store's error
left the gateway as it came (HTTP 500 / gRPC INTERNAL ``internal error: StoreOpenError: ... check that this
user owns it``)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.services.gateway.helpers import new_gateway
from trainguard_server.gateway.grpc import _status
from trainguard_server.gateway.http import error_response
from trainguard_server.gateway.ingest import Unavailable
from trainguard_server.storage.sqlite import TooManyOpenFiles

WHY = "this process has too many open files: all 51 descriptors of its open-files limit (RLIMIT_NOFILE) are in use"


def _out_of_files(*_: Any) -> Any:
    raise TooManyOpenFiles(f"/srv/tg/projects.db cannot be opened now (unable to open database file): {WHY}", WHY)


@pytest.mark.parametrize("method", ["authenticate", "expired_at"])
def test_a_token_check_out_of_descriptors_is_unavailable_naming_the_cause_not_the_path(method: str) -> None:
    gateway, _queue, tokens = new_gateway(retry_after_s=2.0)
    if method == "expired_at":  # a refused token's reason is looked up too
        gateway.projects.authenticate = lambda token: None  # type: ignore[method-assign]
    setattr(gateway.projects, method, _out_of_files)
    with pytest.raises(Unavailable) as caught:
        gateway.authenticate(tokens.ingest)
    exc = caught.value
    assert exc.retry_after == 2.0
    assert WHY in str(exc) and "nothing of this request was queued" in str(exc)
    assert "/srv/tg" not in str(exc)  # the server's paths go to its log, not to clients
    response = error_response(exc)
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"
    assert _status(exc) == (grpc.StatusCode.UNAVAILABLE, (("retry-after", "2"),))
