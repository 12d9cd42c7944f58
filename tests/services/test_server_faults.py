"""Faults around a running ``trainguard serve`` (a real subprocess, real sockets), black-box: what a client is
answered and whether anything it was told is stored goes missing.

- The disk fills while clients send: every write of the server fails from then on (its file-size limit,
  RLIMIT_FSIZE, lowered to 1 byte: SQLite then gets the error a full disk gives). Ingest is answered 503 +
  Retry-After (HTTP) / UNAVAILABLE (gRPC), both retryable, never 200 for what was not queued; ``/readyz`` says
  503 naming the data directory; once there is room again, ingest is 200 and every event acknowledged before,
  during and after is stored, once.
- Clients that drop their connection in the middle of a body give back the bytes it held in the bounds on
  ingest bytes in flight: afterwards a batch of the same project near ``max_batch_bytes`` is admitted (a leak of
  even 4 of the 1 MiB pieces per dropped body would hold the project's 32 MiB bound and answer 429).
- SIGTERM while several HTTP clients are sending: every batch answered 200 is stored when serve has exited 0
  (the queue drained); a batch sent after the stop began is refused or never answered, not acknowledged and
  dropped.
"""

from __future__ import annotations

import json
import resource
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.core.events import new_event_id
from trainguard.transport.base import TransportError
from trainguard.transport.grpc import GrpcTransport
from trainguard_server.storage.sqlite import open_sqlite_stores


def _log(run_id: str, step: int, size: int = 200) -> Dict[str, Any]:
    return {"event_id": new_event_id(), "run_id": run_id, "step": step, "time_unix_nano": time.time_ns(),
            "log": {"logger": "train", "level": "INFO", "message": "x" * size}}


def _post(server: ServeProcess, events: List[Dict[str, Any]],
          timeout: float = 30) -> Tuple[int, bytes, Optional[str]]:
    req = urllib.request.Request(server.http_url + "/v1/ingest", data=json.dumps({"events": events}).encode(),
                                 headers={"Authorization": f"Bearer {server.tokens['ingest']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Retry-After")


def _readyz(server: ServeProcess) -> Tuple[int, bytes]:
    try:
        with urllib.request.urlopen(server.http_url + "/readyz", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stored(data_dir: Path, run_id: str) -> List[str]:
    stores = open_sqlite_stores(data_dir)
    try:
        ids: List[str] = []
        cursor = None
        while True:
            page = stores.events.list_for_run("default", run_id, limit=500, cursor=cursor)
            ids.extend(e.event_id for e in page.items)
            cursor = page.next_cursor
            if not cursor:
                return ids
    finally:
        stores.close()


def test_a_full_disk_is_a_retryable_503_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    acked: Set[str] = set()
    try:
        assert server.proc is not None
        before = [_log("full", i) for i in range(100)]
        assert _post(server, before)[0] == 200
        acked.update(e["event_id"] for e in before)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (1, hard))  # the disk is full from now on
        for k in range(3):
            status, body, retry_after = _post(server, [_log("full", 1000 + 100 * k + i) for i in range(100)])
            assert (status, retry_after) == (503, "1"), (status, body)
            assert b"ingest queue unavailable" in body, body
        transport = GrpcTransport(server.grpc_target, server.tokens["ingest"])
        try:
            transport.send([_log("full", 5000 + i) for i in range(100)], timeout=10)
            raise AssertionError("a gRPC Send on a full disk was acknowledged")
        except TransportError as exc:
            assert "UNAVAILABLE" in str(exc), exc
        status, body = _readyz(server)
        assert status == 503 and b"does not take writes" in body, body
        assert server.proc.poll() is None  # still serving
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # room again
        assert poll(lambda: _readyz(server)[0] == 200, timeout=30)
        after = [_log("full", 9000 + i) for i in range(100)]
        assert _post(server, after)[0] == 200
        acked.update(e["event_id"] for e in after)
        assert poll(lambda: len(server.run_events("full", kinds="log")) >= len(acked), timeout=60)
        ids = [e["event_id"] for e in server.run_events("full", kinds="log")]
        assert set(ids) == acked and len(ids) == len(acked)  # all acknowledged, once; nothing refused stored
    finally:
        server.stop()


def _dropped_body(port: int, token: str, declared: int, send: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
        conn.sendall(b"[" * send)
        conn.shutdown(socket.SHUT_RDWR)


def test_clients_dropping_mid_body_give_their_bytes_back(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    try:
        assert server.http_port
        for _ in range(40):  # 40 bodies declaring 8 MB, each dropped after 1 MiB
            _dropped_body(server.http_port, server.tokens["ingest"], 8_000_000, 2**20)
        big = [_log("dropped", i, size=60_000) for i in range(120)]  # ~7.2 MB: needs the project's room

        def admitted() -> bool:
            try:
                return _post(server, big)[0] == 200
            except OSError:  # a 429 sent while the body is still being sent may reset the connection
                return False

        # within 10 s: well before the 30 s body timeout would end a body the server had not seen dropped
        assert poll(admitted, timeout=10, interval=0.5)
        status, _ = _readyz(server)
        assert status == 200
    finally:
        server.stop()


def test_sigterm_while_clients_send_stores_every_acknowledged_batch(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    acked: Set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    counts = {"ok": 0, "refused": 0}

    def sender(k: int) -> None:
        step = 0
        while not stop.is_set():
            batch = [_log("drain", k * 1_000_000 + step + i) for i in range(50)]
            step += 50
            try:
                status, _, _ = _post(server, batch, timeout=20)
            except OSError:  # the server closed or stopped answering: not acknowledged
                counts["refused"] += 1
                continue
            with lock:
                if status == 200:
                    acked.update(e["event_id"] for e in batch)
                    counts["ok"] += 1
                else:
                    counts["refused"] += 1

    threads = [threading.Thread(target=sender, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        assert poll(lambda: counts["ok"] >= 40, timeout=60)
        server.signal(signal.SIGTERM)  # mid-stream: the senders go on until the process is gone
        assert server.wait(60) == 0, "".join(server.output)[-3000:]
        stop.set()
        for t in threads:
            t.join(30)
        assert "queue drained" in "".join(server.output)
        stored = _stored(tmp_path / "data", "drain")
        assert acked <= set(stored), f"{len(acked - set(stored))} acknowledged events lost"
        assert len(stored) == len(set(stored))
    finally:
        stop.set()
        server.stop()


def _mixed(run_id: str, start: int, count: int) -> List[Dict[str, Any]]:
    """Logs, and 1 in 10 an exception of one stack fingerprint (one cluster, whose count must stay exact)."""
    events = []
    for i in range(start, start + count):
        payload = ({"exception": {"type": "ValueError", "message": "bad batch",
                                  "frames": [{"filename": "/w/train.py", "module": "train",
                                              "function": "step", "lineno": 10, "in_app": True}]}}
                   if i % 10 == 0 else {"log": {"logger": "train", "level": "WARNING", "message": f"line {i}"}})
        events.append({"event_id": new_event_id(), "run_id": run_id, "step": i, "rank": i % 4,
                       "time_unix_nano": time.time_ns(), "severity": "WARNING", **payload})
    return events


def test_kill_9_while_http_and_grpc_clients_send_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """bench/kill9.py's measure as a pass/fail test: 2 HTTP and 2 gRPC senders at once, SIGKILL mid-ingest,
    restart on the same data directory; every acknowledged event is stored once, and the exception cluster's
    count equals the exceptions stored (records redelivered after the kill were not counted twice)."""
    server = ServeProcess(tmp_path / "data").start()
    run_id = "kill9-mixed"
    acked: Set[str] = set()
    acked_exceptions: Set[str] = set()
    lock = threading.Lock()
    killed = threading.Event()
    batches = [0]

    def sender(k: int) -> None:
        transport = GrpcTransport(server.grpc_target, server.tokens["ingest"]) if k % 2 else None
        step = k * 1_000_000
        try:
            while not killed.is_set():
                batch = _mixed(run_id, step, 50)
                step += 50
                try:
                    if transport is not None:
                        ok = not transport.send(batch, timeout=10).rejected
                    else:
                        ok = _post(server, batch, timeout=10)[0] == 200
                except (OSError, TransportError):
                    ok = False
                if ok:
                    with lock:
                        acked.update(e["event_id"] for e in batch)
                        acked_exceptions.update(e["event_id"] for e in batch if "exception" in e)
                        batches[0] += 1
                elif not killed.is_set():
                    time.sleep(0.05)
        finally:
            if transport is not None:
                transport.close()

    threads = [threading.Thread(target=sender, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        assert poll(lambda: batches[0] >= 60, timeout=60)
        server.signal(signal.SIGKILL)  # the processor is busy with what came before
        assert server.wait(10) == -signal.SIGKILL
    finally:
        killed.set()
        for t in threads:
            t.join(30)
    restarted = ServeProcess(tmp_path / "data")
    restarted.http_port, restarted.grpc_port = 0, 0
    restarted.start()
    try:
        def stored() -> List[Dict[str, Any]]:
            return restarted.run_events(run_id, kinds="log,exception")

        poll(lambda: len(stored()) >= len(acked), timeout=90, interval=0.5)
        items = stored()
        ids = [e["event_id"] for e in items]
        assert acked <= set(ids), f"{len(acked - set(ids))} of {len(acked)} acknowledged events lost"
        assert len(ids) == len(set(ids)), "an event stored twice"
        exceptions = {e["event_id"] for e in items if e["kind"] == "exception"}
        assert exceptions >= acked_exceptions

        def the_cluster() -> Any:
            found = [c for c in restarted.get("/api/v1/clusters")["items"] if run_id in c["runs"]]
            return found[0] if found and found[0]["count"] >= len(exceptions) else None

        cluster = poll(the_cluster, timeout=60, interval=0.5)
        assert cluster is not None, restarted.get("/api/v1/clusters")["items"]
        assert cluster["count"] == len(exceptions)
    finally:
        restarted.stop()


def test_sigterm_with_grpc_sends_waiting_for_their_message_ends_them_cleanly(tmp_path: Path) -> None:
    """20 ``Send`` calls stalled 1 byte short of their message (4 reading, 16 waiting for room: H34) when
    SIGTERM comes: each is ended UNAVAILABLE, serve exits 0 within seconds, and no call's task is left for the
    loop to destroy (before, one "Task was destroyed but it is pending!" ERROR per waiting call)."""
    from tests.services.gateway.grpc_raw import StalledCalls

    server = ServeProcess(tmp_path / "data", env={
        # only the stop may end the waiting calls: with the default 5 s a slow machine's upload lets some
        # waiters give up first (RESOURCE_EXHAUSTED) before the SIGTERM (hR's review, stop 42)
        "TRAINGUARD_GRPC_RECEIVE_WAIT_S": "60"}).start()
    host, port = server.grpc_target.rsplit(":", 1)
    calls = StalledCalls(host, int(port), 20, 8_000_000, token=server.tokens["ingest"])
    try:
        calls.pump(quiet_s=1.0, deadline_s=30)
        server.signal(signal.SIGTERM)
        assert server.wait(40) == 0, "".join(server.output)[-3000:]
        output = "".join(server.output)
        assert "queue drained" in output
        assert "Task was destroyed but it is pending" not in output, output[-3000:]
        assert poll(lambda: len(calls.status) == 20, timeout=10)
        assert set(calls.status.values()) == {14}, calls.status  # UNAVAILABLE: the SDK retries it
    finally:
        calls.close()
        server.stop()
