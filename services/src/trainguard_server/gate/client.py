"""The gate's HTTP client (stdlib only): define/read baselines and ask for a verdict over the query API
with a read token -- what ``trainguard gate --api`` uses."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
from typing import Any, Dict, Optional

from ..api.read_client import ReadClient


class GateClientError(RuntimeError):
    """The API refused the request (status and its ``detail``) or could not be reached."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class GateClient:
    def __init__(self, base: str, token: str, timeout: float = 60.0) -> None:
        self.api = ReadClient(base, token, timeout, user_agent="trainguard-gate")
        self.base = self.api.base

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        try:
            return self.api.request(method, path, body)
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("detail", "")
            except (ValueError, AttributeError):
                detail = ""
            raise GateClientError(f"{method} {path}: HTTP {exc.code}: {detail or exc.reason}",
                                  exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise GateClientError(f"cannot reach {self.base}: {reason}") from None

    def define_baseline(self, name: str, body: Dict[str, Any]) -> Dict[str, Any]:
        result: Dict[str, Any] = self._call("PUT", _baseline_path(name), body)
        return result

    def get_baseline(self, name: str) -> Optional[Dict[str, Any]]:
        try:
            result: Dict[str, Any] = self._call("GET", _baseline_path(name))
            return result
        except GateClientError as exc:
            if exc.status == 404:
                return None
            raise

    def run_status(self, run_id: str) -> Optional[str]:
        try:
            run = self._call("GET", f"/api/v1/runs/{urllib.parse.quote(run_id, safe='')}")
        except GateClientError as exc:
            if exc.status == 404:
                return None
            raise
        return str(run.get("status", "")) if isinstance(run, dict) else None

    def gate(self, baseline: str, candidate: str, policy: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        body = {"baseline": baseline, "candidate": candidate, "policy": policy}
        result: Dict[str, Any] = self._call("POST", "/api/v1/gate", body)
        return result


def _baseline_path(name: str) -> str:
    return f"/api/v1/baselines/{urllib.parse.quote(name, safe='')}"
