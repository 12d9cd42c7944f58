"""Liveness, readiness and the server's own Prometheus metrics."""

from __future__ import annotations

from typing import Dict, List

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from ..deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is up")
def healthz() -> Dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Ready to ingest: stores answer, the processor runs, the queue has room")
def readyz(services: ServicesDep) -> JSONResponse:
    problems: List[str] = []
    processor = services.processor
    if processor is not None and not processor.alive:
        problems.append("processor thread is not running")
    if services.queue is not None and services.settings is not None:
        depth = services.queue.depth()
        if depth >= services.settings.max_queue_depth:
            problems.append(f"queue is full ({depth} batches)")
    try:
        services.incidents.load_state("readyz-probe")
    except Exception as exc:  # a store that cannot answer
        problems.append(f"incident store: {exc}")
    if problems:
        return JSONResponse({"status": "unavailable", "problems": problems}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text format")
def metrics(services: ServicesDep) -> PlainTextResponse:
    from ...observability import render_prometheus

    return PlainTextResponse(render_prometheus(services), media_type="text/plain; version=0.0.4")
