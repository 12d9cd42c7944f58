"""A real query API for the issue-18 read-path tests: SQLite stores under a temporary directory, the app of
``create_app`` (with HTTP ingest) served by uvicorn on 127.0.0.1, and an SSE line reader."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx

from tests.services.gateway.helpers import UvicornThread
from trainguard_engine.records import RunRecord
from trainguard_server.api.app import create_app
from trainguard_server.api.deps import Services
from trainguard_server.config import Settings
from trainguard_server.gateway.http import ingest_router
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.storage.sqlite import open_sqlite_stores

PROJECT = "vision"


class LiveApi:
    """Stores, tokens, one run record and a started server; ``close()`` stops it all."""

    def __init__(self, data_dir: Path, **settings: Any) -> None:
        self.settings = Settings(data_dir=data_dir, **settings)
        self.stores = open_sqlite_stores(data_dir, synchronous="NORMAL")
        self.queue = MemoryQueue()
        self.gateway = Gateway(self.queue, self.stores.projects, self.settings)
        self.services = Services(events=self.stores.events, metrics=self.stores.metrics,
                                 incidents=self.stores.incidents, projects=self.stores.projects,
                                 queue=self.queue, gateway=self.gateway, settings=self.settings)
        self.read_token = self.stores.projects.create_token(PROJECT, "read")
        self.ingest_token = self.stores.projects.create_token(PROJECT, "ingest")
        self.run = RunRecord(project=PROJECT, run_id="run-1", run_name="resnet", started_ns=time.time_ns(),
                             last_step=0)
        self.stores.incidents.upsert_runs([self.run])
        self.app = create_app(self.services, ingest_router(self.gateway))
        self.server = UvicornThread(self.app).__enter__()
        self.url = self.server.url

    def headers(self, token: Optional[str] = None) -> Dict[str, str]:
        return {"Authorization": f"Bearer {token or self.read_token}"}

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        self.stores.close()


def sse_messages(response: httpx.Response) -> Iterator[Tuple[str, Any]]:
    """``(event, data)`` of each server-sent message until the stream ends (comments skipped)."""
    event, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "" and data:
            yield event, json.loads(data)
            event, data = "message", ""


def take(messages: Iterator[Tuple[str, Any]], count: int) -> List[Tuple[str, Any]]:
    return [next(messages) for _ in range(count)]
