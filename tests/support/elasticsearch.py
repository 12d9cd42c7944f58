"""A real Elasticsearch API for the tests: noida-db 0.2.3 (PyPI), whose single binary
(``noida_db/noida-db`` inside the package) serves an ES-8.15-compatible HTTP API that the official client
accepts (DESIGN §5). Started as a process we hold the PID of, on a free 127.0.0.1 port, with its data in a
temporary directory; ``make install`` installs it, and a missing install fails the tests that need it.

- :class:`NoidaElasticsearch` — one server: ``start()`` (waits for ``/_cluster/health``), ``stop()``.
- :class:`FaultProxy` — an HTTP proxy on loopback in front of it that can answer the next bulk requests
  with an error status, or rewrite some items of a bulk answer to an error (429/5xx/4xx), so the store's
  retry and rejection paths run against the real server.

noida-db keeps each service's data in one JSON file and is slow past ~100k documents: keep test data small.
"""

from __future__ import annotations

import http.client
import http.server
import importlib.util
import json
import os
import signal
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from tests.support.net import free_port


def noida_binary() -> Path:
    spec = importlib.util.find_spec("noida_db")
    if spec is None or spec.origin is None:
        raise RuntimeError("noida-db is not installed (make install installs it): no Elasticsearch API to test")
    path = Path(spec.origin).parent / "noida-db"
    if not path.is_file():
        raise RuntimeError(f"no noida-db binary at {path}")
    if not os.access(path, os.X_OK):  # some installers drop the mode bits; noida's own CLI chmods too
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class NoidaElasticsearch:
    """One noida-db process serving only its Elasticsearch API on 127.0.0.1:``port``."""

    def __init__(self, data_dir: Path, port: Optional[int] = None) -> None:
        self.binary = noida_binary()
        self.data_dir = data_dir
        self.port = port or free_port()
        self.log_path = data_dir / "noida.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> NoidaElasticsearch:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "start", "--data-dir", str(self.data_dir / "data"), "--host", "127.0.0.1",
                 "--only", "elasticsearch", "--elasticsearch-port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/_cluster/health", timeout=1) as answer:
                    if answer.status == 200 and json.load(answer).get("status") in ("green", "yellow"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop()
                raise RuntimeError(f"noida-db (Elasticsearch API) did not become healthy on {self.url} "
                                   f"(exit code {code})\n--- log ---\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class FaultProxy:
    """A loopback HTTP proxy to ``upstream`` that injects faults into ``_bulk`` calls.

    ``fail_requests(status, n)``: the next ``n`` bulk requests are answered ``status`` without reaching
    the server. ``fail_items(status, error_type, n, first)``: the next ``n`` bulk answers have their
    first ``first`` items replaced by that error — the server did not store those documents, because the
    proxy removes them from the request before forwarding it. ``bulk_requests`` counts bulk calls seen.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.bulk_requests = 0
        self._lock = threading.Lock()
        self._request_faults: List[int] = []
        self._item_faults: List[Tuple[int, str, int]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, headers, payload = proxy._handle(self.command, self.path, dict(self.headers), body)
                self.send_response(status)
                for key, value in headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="es-fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_requests(self, status: int, n: int = 1) -> None:
        with self._lock:
            self._request_faults += [status] * n

    def fail_items(self, status: int, error_type: str, n: int = 1, first: int = 1) -> None:
        with self._lock:
            self._item_faults += [(status, error_type, first)] * n

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, method: str, path: str, headers: Dict[str, str],
                body: bytes) -> Tuple[int, Dict[str, str], bytes]:
        is_bulk = path.split("?")[0].endswith("/_bulk")
        item_fault: Optional[Tuple[int, str, int]] = None
        if is_bulk:
            with self._lock:
                self.bulk_requests += 1
                if self._request_faults:
                    status = self._request_faults.pop(0)
                    error = {"error": {"type": "injected", "reason": f"injected {status}"}, "status": status}
                    return status, {"Content-Type": "application/json", "X-Elastic-Product": "Elasticsearch"}, \
                        json.dumps(error).encode()
                if self._item_faults:
                    item_fault = self._item_faults.pop(0)
        dropped: List[Dict[str, Any]] = []
        if item_fault is not None:
            lines = [line for line in body.split(b"\n") if line.strip()]
            pairs = [(json.loads(lines[i]), lines[i + 1]) for i in range(0, len(lines), 2)]
            status, error_type, first = item_fault
            dropped = [action for action, _ in pairs[:first]]
            body = b"".join(lines[i] + b"\n" for i in range(2 * len(dropped), len(lines)))
            if not body:  # everything dropped: answer without the server
                items = [self._fault_item(a, status, error_type) for a in dropped]
                return 200, {"Content-Type": "application/json", "X-Elastic-Product": "Elasticsearch"}, \
                    json.dumps({"errors": True, "took": 0, "items": items}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            fwd = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length", "connection")}
            conn.request(method, path, body=body if method not in ("GET", "HEAD") or body else None, headers=fwd)
            answer = conn.getresponse()
            payload = answer.read()
            out_headers = dict(answer.getheaders())
            status_code = answer.status
        finally:
            conn.close()
        if dropped and item_fault is not None:
            data = json.loads(payload)
            data["items"] = [self._fault_item(a, item_fault[0], item_fault[1]) for a in dropped] + data["items"]
            data["errors"] = True
            payload = json.dumps(data).encode()
        return status_code, out_headers, payload

    @staticmethod
    def _fault_item(action: Dict[str, Any], status: int, error_type: str) -> Dict[str, Any]:
        op, meta = next(iter(action.items()))
        return {op: {"_index": meta.get("_index"), "_id": meta.get("_id"), "status": status,
                     "error": {"type": error_type, "reason": f"injected {error_type}"}}}


def make_test_store(url: str, request: Any, **options: Any) -> Any:
    """An ElasticsearchEventStore on ``url`` with a prefix of its own (tests never see each other's
    events), no replicas (one node) and short backoffs; its indices and template are deleted when
    ``request`` (a pytest request) finishes."""
    import uuid

    from elasticsearch import Elasticsearch

    from trainguard_server.storage.elasticsearch import ElasticsearchEventStore

    client = Elasticsearch(url, request_timeout=30)
    settings: Dict[str, Any] = {"index_prefix": f"tgtest-{uuid.uuid4().hex[:12]}", "replicas": 0,
                                "initial_backoff_s": 0.01, "max_backoff_s": 0.05}
    settings.update(options)
    store = ElasticsearchEventStore(client, **settings)

    def clean() -> None:
        try:
            names = store.indices()
            for i in range(0, len(names), 50):
                client.indices.delete(index=",".join(names[i:i + 50]), ignore_unavailable=True)
            client.options(ignore_status=404).indices.delete_index_template(name=store.template_name)
        finally:
            client.close()

    request.addfinalizer(clean)
    return store
