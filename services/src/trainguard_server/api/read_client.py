"""A minimal client of the query API with a read token (stdlib only): what the demo, ``trainguard replay``
and a person with curl use."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ReadClient:
    """``GET`` JSON from the query API at ``base`` (``http://host:port``) with a read token."""

    def __init__(self, base: str, token: str, timeout: float = 10.0) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout

    def get(self, path: str, **params: Any) -> Any:
        """The decoded JSON of ``GET base+path?params`` (None-valued params dropped); None on a 404.
        Other HTTP errors raise ``urllib.error.HTTPError``."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        request = urllib.request.Request(f"{self.base}{path}" + (f"?{query}" if query else ""),
                                         headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
