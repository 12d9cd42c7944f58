"""A minimal client of the query API with a token (stdlib only): what the demo, ``trainguard replay`` and
``trainguard gate`` use."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ReadClient:
    """JSON requests to the query API at ``base`` (``http://host:port``) with a token."""

    def __init__(self, base: str, token: str, timeout: float = 10.0, user_agent: str = "") -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.user_agent = user_agent

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        """The decoded JSON answer of ``method base+path?params`` (None-valued params dropped) with ``body``
        as JSON (None: no body). HTTP errors raise ``urllib.error.HTTPError``, an unreachable server
        ``urllib.error.URLError`` / ``OSError``."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if self.user_agent:
            headers["User-Agent"] = self.user_agent
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(f"{self.base}{path}" + (f"?{query}" if query else ""), data=data,
                                         headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def get(self, path: str, **params: Any) -> Any:
        """The decoded JSON of ``GET base+path?params`` (None-valued params dropped); None on a 404.
        Other HTTP errors raise ``urllib.error.HTTPError``."""
        try:
            return self.request("GET", path, **params)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
