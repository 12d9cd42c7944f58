"""Liveness, readiness and the server's own Prometheus metrics.

``/readyz`` answers 503 with the list of problems when ingest cannot be served durably: the processor's
thread is not running, its checkpoints or rounds are failing (nothing is committed: the queue only grows),
the queue is full, the incident store does not answer, the data directory was deleted or replaced while the
server runs (its SQLite stores write on into unlinked files, lost with them), or the data directory's file
system is nearly full (less than ``min_free_disk_bytes`` free) or refuses a write of :data:`WRITE_PROBE_BYTES`
(a full disk, a read-only file system, a file-size limit). ``notes`` lists what an operator should see without
the server being unready: the runs the processor's pipeline workers left out of detection (one project's run
must not take the server out of service for every project).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from ..deps import ServicesDep, directory_id

router = APIRouter(tags=["health"])

WRITE_PROBE_BYTES = 64 * 1024
"""What /readyz writes (then deletes) under the data directory to tell that it takes writes: a SQLite page
write of the stores is far smaller, a batch of the queue about this size."""


@router.get("/healthz", summary="The process is up")
def healthz() -> Dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Ready to ingest: stores answer, the processor runs and commits, the queue "
            "and the disk have room")
def readyz(services: ServicesDep) -> JSONResponse:
    problems: List[str] = []
    processor = services.processor
    if processor is not None and not processor.alive:
        problems.append("processor thread is not running")
    if processor is not None:
        problems += getattr(processor, "problems", list)()  # checkpoints or rounds failing
    if services.queue is not None and services.settings is not None:
        depth = services.queue.depth()
        if depth >= services.settings.max_queue_depth:
            problems.append(f"queue is full ({depth} batches)")
    gone = _data_dir_gone(services)
    if gone:
        problems.append(gone)
    disk = None if gone else _disk_problem(services.settings)
    if disk:
        problems.append(disk)
    try:
        services.incidents.load_state("readyz-probe")
    except Exception as exc:  # a store that cannot answer
        problems.append(f"incident store: {exc}")
    notes: List[str] = getattr(processor, "notes", list)() if processor is not None else []
    extra = {"notes": notes} if notes else {}  # e.g. a run left out of detection: shown, not unready
    if problems:
        return JSONResponse({"status": "unavailable", "problems": problems, **extra}, status_code=503)
    return JSONResponse({"status": "ready", **extra})


def _data_dir_gone(services: Any) -> Optional[str]:
    """Why the data directory the server started with is no longer what it writes to: deleted, or another
    directory now at its path; None when it is the same one (or the server started without one)."""
    started = getattr(services, "data_dir_id", None)
    data_dir = getattr(services.settings, "data_dir", None)
    if started is None or data_dir is None:
        return None
    now = directory_id(data_dir)
    if now == started:
        return None
    what = "was deleted" if now is None else "was replaced by another directory"
    return (f"data directory {data_dir} {what} while the server runs: its stores write on into files no "
            f"longer there (lost with them); stop the server, restore the directory (or start it on a new "
            f"one) and start it again")


def _disk_problem(settings: Any) -> Optional[str]:
    """Why the data directory cannot take the stores' writes: less than ``min_free_disk_bytes`` free, or a
    write of WRITE_PROBE_BYTES refused; None when it can (or is not checked: no data directory -- the
    server creates it at start, only in-memory stores go without -- or ``min_free_disk_bytes`` 0)."""
    least = getattr(settings, "min_free_disk_bytes", 0)
    data_dir = getattr(settings, "data_dir", None)
    if not least or data_dir is None or not os.path.isdir(data_dir):
        return None  # not checked, or nothing of ours lives there (in-memory stores)
    try:
        free = shutil.disk_usage(data_dir).free
    except OSError as exc:
        return f"data directory {data_dir}: {exc}"
    if free < least:
        return (f"disk nearly full: {free / 2**20:.1f} MiB free under {data_dir} (less than "
                f"min_free_disk_bytes, {least / 2**20:.0f} MiB)")
    probe = os.path.join(str(data_dir), f".readyz-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = os.write(fd, b"\0" * WRITE_PROBE_BYTES)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return f"data directory {data_dir} does not take writes: {exc}"
    if written < WRITE_PROBE_BYTES:  # a file-size limit or a full disk can cut a write short
        return f"data directory {data_dir} does not take writes: {written} of {WRITE_PROBE_BYTES} bytes went"
    return None


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text format")
def metrics(services: ServicesDep) -> PlainTextResponse:
    from ...observability import render_prometheus

    return PlainTextResponse(render_prometheus(services), media_type="text/plain; version=0.0.4")
