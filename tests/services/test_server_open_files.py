"""A burst of connections past ``trainguard serve``'s open-files limit (security.md H46), black-box.

A request handled on a thread new to the server opens that thread's SQLite reader of the projects database
for its token check; with every descriptor held by the burst the open fails with EMFILE, which SQLite reports
only as 'unable to open database file'. Before stop 45 that was ``StoreOpenError`` blaming the file's
permissions and answered **500** (``internal error``), a status the client cannot tell from a bug. Now it is
503 + ``Retry-After`` naming the cause (too many open files) -- ingest and the query API alike, nothing of
an ingest request queued -- and once
descriptors are free again every batch -- answered 200 during the burst, or resent after its 503 -- is stored
once."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard.core.events import new_event_id

RUN = "burst"
SPARE = 12  # descriptors left to the server above what it holds when idle
BURST = 80  # concurrent ingest requests, each on its own connection
READS = 20  # concurrent query-API reads with them


def _batch(k: int) -> List[Dict[str, Any]]:
    return [{"event_id": new_event_id(), "run_id": RUN, "step": k, "time_unix_nano": time.time_ns(),
             "log": {"logger": "train", "level": "INFO", "message": f"batch {k} event {i}"}} for i in range(5)]


def _post(server: ServeProcess, events: List[Dict[str, Any]]) -> Tuple[Any, bytes, Optional[str]]:
    req = urllib.request.Request(server.http_url + "/v1/ingest", data=json.dumps({"events": events}).encode(),
                                 headers={"Authorization": f"Bearer {server.tokens['ingest']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Retry-After")
    except OSError as exc:  # no answer (reset, timed out): not acknowledged, resent below
        return type(exc).__name__, b"", None


def _read(server: ServeProcess) -> Tuple[Any, bytes, Optional[str]]:
    req = urllib.request.Request(server.http_url + f"/api/v1/runs/{RUN}/events?limit=5",
                                 headers={"Authorization": f"Bearer {server.tokens['read']}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Retry-After")
    except OSError as exc:
        return type(exc).__name__, b"", None


def test_a_burst_past_the_open_files_limit_is_a_retryable_503_naming_the_cause_and_loses_nothing(
        tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    assert server.proc is not None
    pid = server.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    batches: Dict[int, List[Dict[str, Any]]] = {}
    answers: Dict[int, Tuple[Any, bytes, Optional[str]]] = {}
    refused: List[Tuple[Any, bytes, Optional[str]]] = []
    reads: List[Tuple[Any, bytes, Optional[str]]] = []  # the query API's answers meanwhile
    try:
        batches[0] = _batch(0)
        assert _post(server, batches[0])[0] == 200
        for round_ in range(5):  # until the burst meets the limit (the first did in every run seen)
            held = len(os.listdir(f"/proc/{pid}/fd"))
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + SPARE, hard))
            ks = range(1 + BURST * round_, 1 + BURST * (round_ + 1))
            for k in ks:
                batches[k] = _batch(k)

            def send(k: int) -> None:
                answers[k] = _post(server, batches[k])

            def read() -> None:
                reads.append(_read(server))

            threads = [threading.Thread(target=send, args=(k,)) for k in ks]
            threads += [threading.Thread(target=read) for _ in range(READS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            refused = [a for a in list(answers.values()) + reads if a[0] != 200]
            if refused:
                break
        assert refused, "no request of the bursts met the open-files limit"
        for status, body, retry_after in refused:
            assert status != 500, body  # before: 500 "internal error: StoreOpenError: ... check that this user owns it"
            if status == 503:
                assert retry_after == "1", (retry_after, body)
                assert b"too many open files" in body and b"RLIMIT_NOFILE" in body, body
                assert b"retry after 1 s" in body, body
        assert any(a[0] == 503 for a in refused), [a[0] for a in refused]
        for k, answer in list(answers.items()):  # the client's retry, descriptors free again
            if answer[0] != 200:
                status, body, _ = _post(server, batches[k])
                assert status == 200, (status, body)
        expected = {e["event_id"] for batch in batches.values() for e in batch}
        assert poll(lambda: len(server.run_events(RUN, kinds="log")) >= len(expected),
                    timeout=60)
        ids = [e["event_id"] for e in server.pages(f"/api/v1/runs/{RUN}/events", kinds="log")]
        assert set(ids) == expected and len(ids) == len(expected)  # every batch stored, once
    finally:
        server.stop()
    log = "".join(server.output)
    assert "Traceback" not in log, log[-3000:]  # before: a traceback per refused request
    assert log.count("token check answered 503") <= 3, log[-3000:]  # one line per 10 s, not one per request
