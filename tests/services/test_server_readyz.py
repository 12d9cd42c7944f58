"""Issue 18, finding 10: ``/readyz`` said ready while the disk was full or checkpoints failed.

Now it answers 503 with the problem -- the data directory refuses writes or is nearly full, the processor's
checkpoints (or rounds) fail -- and ready again once it clears. On a real ``trainguard serve``: a full disk is
the server's file-size limit (RLIMIT_FSIZE) lowered to 1 byte; a nearly full one a ``min_free_disk_bytes``
above what the disk has free. In process: the incident store's SQLite file capped at its current page count
(``max_page_count``: SQLite's own "database or disk is full"), under the real query API."""

from __future__ import annotations

import json
import resource
import shutil
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
from fastapi.testclient import TestClient

from tests.engine.test_pipeline_poison import healthy_run
from tests.services.e2e.serve_process import ServeProcess
from tests.services.processor.test_poison_run import Backend, _now
from tests.support.waiting import poll
from trainguard_server.api.app import create_app
from trainguard_server.api.deps import Services
from trainguard_server.config import Settings
from trainguard_server.processor.embedded import EmbeddedProcessor


def _readyz(url: str) -> Tuple[int, Dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_readyz_reports_a_data_directory_that_refuses_writes_and_recovers(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    try:
        assert _readyz(server.http_url) == (200, {"status": "ready"})
        assert server.proc is not None
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))  # disk "full"
        code, body = _readyz(server.http_url)
        assert code == 503, body  # 200 'ready' before the fix
        assert any("does not take writes" in p for p in body["problems"]), body
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        assert _readyz(server.http_url) == (200, {"status": "ready"})
    finally:
        server.stop()


def test_readyz_reports_a_data_directory_deleted_under_the_server(tmp_path: Path) -> None:
    """Stop 31's fault review: a data directory deleted under a running serve went unnoticed -- the server
    answered 'ready' and wrote on into the unlinked files. Also a directory put back at its path is not the
    one the stores write to."""
    server = ServeProcess(tmp_path / "data").start()
    try:
        assert _readyz(server.http_url) == (200, {"status": "ready"})
        shutil.rmtree(tmp_path / "data")
        code, body = _readyz(server.http_url)
        assert code == 503, body  # 200 'ready' before
        assert any("data directory" in p and "was deleted while the server runs" in p
                   for p in body["problems"]), body
        (tmp_path / "data").mkdir()  # an empty directory at the same path: still not the stores' one
        code, body = _readyz(server.http_url)
        assert code == 503 and any("was replaced by another directory" in p for p in body["problems"]), body
    finally:
        server.stop()


def test_readyz_reports_a_nearly_full_disk(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    beyond = shutil.disk_usage(tmp_path).free + 2**40  # more than this disk has free
    server = ServeProcess(tmp_path / "data", env={"TRAINGUARD_MIN_FREE_DISK_BYTES": str(beyond)}).start()
    try:
        code, body = _readyz(server.http_url)
        assert code == 503, body  # 200 'ready' before the fix
        assert any(p.startswith("disk nearly full: ") and "min_free_disk_bytes" in p for p in body["problems"])
    finally:
        server.stop()


def test_readyz_reports_failing_checkpoints_and_recovers(tmp_path: Path) -> None:
    backend = Backend(tmp_path)
    processor = EmbeddedProcessor(backend.queue, backend.events, backend.metrics, backend.incidents,
                                  snapshot_every_s=0.05, tick_interval_s=0.05)
    services = Services(events=backend.events, metrics=backend.metrics, incidents=backend.incidents,
                        projects=backend.projects, queue=backend.queue, processor=processor,
                        settings=Settings(data_dir=tmp_path))
    client = TestClient(create_app(services))
    writer = backend.incidents._db._writer  # the store's one writer connection
    pages = writer.execute("PRAGMA page_count").fetchone()[0]
    processor.start()
    try:
        assert client.get("/readyz").json() == {"status": "ready"}
        writer.execute(f"PRAGMA max_page_count = {pages}")  # the incident store's "disk" is full
        backend.publish(_now(healthy_run("calm", "calm", 300)))
        assert poll(lambda: backend.incidents.list_incidents("calm").items or processor.stats.errors, timeout=30)
        answer = poll(lambda: (r := client.get("/readyz")).status_code == 503 and r, timeout=10)
        assert answer, client.get("/readyz").json()  # 200 'ready' before the fix, while every round failed
        problems = " | ".join(answer.json()["problems"])
        assert "processing failing" in problems or "checkpoints failing" in problems, problems
        assert "database or disk is full" in problems, problems
        assert "trainguard_checkpoint_failures " in client.get("/metrics").text
        writer.execute("PRAGMA max_page_count = 1073741823")  # room again
        assert poll(lambda: client.get("/readyz").status_code == 200, timeout=60, interval=0.2)
        assert poll(lambda: backend.queue.depth() == 0, timeout=30)  # everything committed after all
    finally:
        writer.execute("PRAGMA max_page_count = 1073741823")
        processor.stop(drain=False, timeout=10)
        backend.close()


def test_readyz_reports_a_checkpoint_that_fails_on_a_full_store(tmp_path: Path) -> None:
    backend = Backend(tmp_path)
    processor = EmbeddedProcessor(backend.queue, backend.events, backend.metrics, backend.incidents,
                                  snapshot_every_s=3600)
    client = TestClient(create_app(Services(
        events=backend.events, metrics=backend.metrics, incidents=backend.incidents, projects=backend.projects,
        queue=backend.queue, processor=processor, settings=Settings(data_dir=tmp_path))))
    writer = backend.incidents._db._writer
    try:
        backend.publish(_now(healthy_run("calm", "calm", 300)))
        processor.drain(30)  # processed and stored, not checkpointed yet
        writer.execute(f"PRAGMA max_page_count = {writer.execute('PRAGMA page_count').fetchone()[0]}")
        with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
            processor.checkpoint()
        problems = client.get("/readyz").json()["problems"]
        assert any(p.startswith("checkpoints failing (1 in a row; nothing is committed): OperationalError: "
                                "database or disk is full") for p in problems), problems
        assert "trainguard_checkpoint_failures 1.0" in client.get("/metrics").text
        writer.execute("PRAGMA max_page_count = 1073741823")
        processor.checkpoint()
        assert not processor.problems() and backend.queue.depth() == 0
    finally:
        writer.execute("PRAGMA max_page_count = 1073741823")
        backend.close()


def test_a_run_left_out_of_detection_is_a_note_not_unready(tmp_path: Path) -> None:
    """A run whose records end a pipeline worker is left out of detection (processor/left_out.py): /readyz
    names it in ``notes`` and stays 200 -- one project's run must not take the server out of a load balancer's
    rotation for every project (it was a 503 problem when first built)."""
    import time

    backend = Backend(tmp_path)
    processor = EmbeddedProcessor(backend.queue, backend.events, backend.metrics, backend.incidents)
    client = TestClient(create_app(Services(
        events=backend.events, metrics=backend.metrics, incidents=backend.incidents, projects=backend.projects,
        queue=backend.queue, processor=processor, settings=Settings(data_dir=tmp_path))))
    processor.start()
    try:
        processor.poisoned_runs.runs[("tenant-a", "slurm-4242")] = time.monotonic()
        answer = client.get("/readyz")
        assert answer.status_code == 200 and answer.json()["status"] == "ready", answer.json()
        [note] = answer.json()["notes"]
        assert "'slurm-4242' of project 'tenant-a' left out of detection" in note
        processor.poisoned_runs.runs.clear()
        assert client.get("/readyz").json() == {"status": "ready"}
    finally:
        processor.stop(drain=False)
