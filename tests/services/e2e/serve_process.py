"""Run ``trainguard serve`` as a real subprocess on loopback, and talk to it as users do."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Optional

_HTTP_RE = re.compile(r"HTTP ingest \+ API\s+(http://\S+)")
_GRPC_RE = re.compile(r"gRPC ingest\s+grpc://(\S+)")


WORKERS_PINNED = "TRAINGUARD_TEST_WORKERS_PINNED"
"""Set by tests/conftest.py when it pinned TRAINGUARD_PROCESSOR_WORKERS=0 for the suite's in-process servers:
``trainguard serve`` started here then runs its real default instead."""


class ServeProcess:
    """``trainguard serve --data-dir D`` on ephemeral ports (or the ports of a previous start)."""

    def __init__(self, data_dir: Path, env: Optional[Dict[str, str]] = None,
                 nofile: Optional[int] = None) -> None:
        self.data_dir = data_dir
        self.env = env or {}
        self.nofile = nofile  #: the soft open-files limit serve starts with (None: this process's)
        self.proc: Optional[subprocess.Popen[str]] = None
        self.http_url = ""
        self.grpc_target = ""
        self.http_port = 0
        self.grpc_port = 0
        self.output: list[str] = []

    def start(self, timeout: float = 30.0) -> ServeProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        if env.pop(WORKERS_PINNED, None) and "TRAINGUARD_PROCESSOR_WORKERS" not in self.env:
            del env["TRAINGUARD_PROCESSOR_WORKERS"]  # serve's own default (auto), not the suite's pin
        cmd = [sys.executable, "-m", "trainguard_server", "serve", "--data-dir", str(self.data_dir),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        nofile = self.nofile

        def limit() -> None:  # in the child only: the test process keeps its own descriptors' room
            if nofile is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=limit if nofile is not None else None)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("trainguard serve exited: " + "".join(self.output))
            self.output.append(line)
            if m := _HTTP_RE.search(line):
                self.http_url = m.group(1)
                self.http_port = int(self.http_url.rsplit(":", 1)[1])
            if m := _GRPC_RE.search(line):
                self.grpc_target = m.group(1)
                self.grpc_port = int(self.grpc_target.rsplit(":", 1)[1])
            if "tokens are kept in" in line:
                return self
        raise RuntimeError("trainguard serve did not start: " + "".join(self.output))

    @property
    def tokens(self) -> Dict[str, str]:
        doc: Dict[str, str] = json.loads((self.data_dir / "bootstrap-tokens.json").read_text())
        return doc

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        out, _ = self.proc.communicate(timeout=timeout)
        self.output.append(out or "")
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str, **params: Any) -> Any:
        """GET the query API with the read token; returns the JSON (or raises HTTPError)."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(self.http_url + path + (f"?{query}" if query else ""),
                                     headers={"Authorization": f"Bearer {self.tokens['read']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def get_or_none(self, path: str, **params: Any) -> Any:
        try:
            return self.get(path, **params)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def run_events(self, run_id: str, kinds: Optional[str] = None) -> list[Any]:
        """The run's stored events (``kinds``: a comma list); none while the processor has not stored the run
        yet (the API's 404) -- what a poll for a run's events after a (re)start needs."""
        try:
            return self.pages(f"/api/v1/runs/{run_id}/events", kinds=kinds)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            return []

    def pages(self, path: str, **params: Any) -> list[Any]:
        """Every item of a paginated listing."""
        items: list[Any] = []
        cursor = None
        while True:
            page = self.get(path, cursor=cursor, limit=500, **params)
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                return items
