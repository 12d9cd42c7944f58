"""Where a replay goes: a running backend (HTTP or gRPC ingest + the query API) or a data directory
(an in-process gateway and processor over the embedded stores, no server needed).

Contract:

* :meth:`Backend.send` delivers one batch of envelope dicts and returns the per-item
  :class:`~trainguard.transport.base.SendResult`, or raises
  :class:`~trainguard.transport.base.TransportError` (``retryable``, ``retry_after``; status ``"413"`` when
  the batch is too large and should be split) -- the SDK transports' contract, which the remote backends
  reuse as they are.
* :class:`LocalBackend` runs the HTTP JSON ingest path in process: ``encode_batch`` →
  :func:`~trainguard_server.gateway.ingest.batch_from_json` → :meth:`Gateway.ingest_batch`, so events are
  validated, de-duplicated and queued exactly as over HTTP, then the embedded processor runs the pipeline.
  Authentication: ``token`` when given (it must be an ingest token of the data dir), else direct access
  to ``project`` (whoever can write the data directory is its administrator, as with ``trainguard
  token``). Its processor runs no processing-time timers (:data:`NO_TIMERS_S`). Do not point it at a
  data directory a running ``trainguard serve`` uses.
* :meth:`Backend.finish` makes the backend process what it acknowledged (local: drain the queue and
  checkpoint; remote: nothing, the server does it); :meth:`Backend.run` and :meth:`Backend.incidents`
  read the result (``None`` / ``[]`` when unknown; remote ones need a read token and the API URL).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from trainguard.core.events import encode_batch
from trainguard.transport.base import SendResult, Transport, TransportError
from trainguard_engine.catalogue import DetectionSettings

from ..api.read_client import ReadClient
from ..config import Settings
from ..gateway.ingest import (
    Backpressure,
    Gateway,
    GatewayError,
    RequestTooLarge,
    Unavailable,
    batch_from_json,
)
from ..processor.embedded import EmbeddedProcessor
from ..queue import embedded_partitions
from ..queue.sqlite import QUEUE_DB, SqliteQueue
from ..storage.base import TokenInfo
from ..storage.sqlite import open_sqlite_stores

Event = Dict[str, Any]
TOKENS_FILE = "bootstrap-tokens.json"
NO_TIMERS_S = 1e15
"""The local processor's timer interval: never. Processing-time timers (a run silent for ``lost_after_s``,
eviction) judge live runs by the wall clock; a replayed run's events are hours or months old, so they
would call it lost while its history is still being read. ``trainguard serve`` runs them later."""


class Backend:
    """Sends batches and reads back what the backend made of a run."""

    description = "backend"
    can_report = False

    def send(self, events: Sequence[Event], timeout: float) -> SendResult:
        raise NotImplementedError

    def mark(self) -> None:
        """Remember how much the backend had ingested once everything was sent (see :meth:`caught_up`)."""

    def caught_up(self) -> bool:
        """Whether the backend processed everything it had ingested at :meth:`mark` (False: unknown)."""
        return False

    def finish(self) -> None:
        """Process everything acknowledged so far (where this side can)."""

    def run(self, run_id: str) -> Optional[Dict[str, Any]]:
        return None

    def incidents(self, run_id: str) -> List[Dict[str, Any]]:
        return []

    def close(self) -> None:
        """Release connections and files. Safe to call twice."""


# ----------------------------------------------------------------------------------------------- remote

class RemoteBackend(Backend):
    """``trainguard serve`` (or a gateway) at ``endpoint``: ``http(s)://`` or ``grpc(s)://``; the query API at
    ``api`` (default: the endpoint when it is HTTP) with ``read_token``."""

    def __init__(self, endpoint: str, token: Optional[str], *, read_token: Optional[str] = None,
                 api: Optional[str] = None, user_agent: str = "trainguard-replay") -> None:
        scheme = endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""
        self.transport: Transport
        if scheme in ("http", "https"):
            from trainguard.transport.http import HttpTransport

            self.transport = HttpTransport(endpoint, token, user_agent)
            api = api or endpoint
        elif scheme in ("grpc", "grpcs"):
            from trainguard.transport.grpc import GrpcTransport

            self.transport = GrpcTransport(endpoint.split("://", 1)[1].rstrip("/"), token,
                                           secure=scheme == "grpcs")
        else:
            raise ValueError(f"unsupported endpoint {endpoint!r}: use http(s)://host:port or grpc(s)://host:port")
        self.description = endpoint
        self.api = api.rstrip("/") if api else None
        self.read_token = read_token
        self.can_report = bool(self.api and read_token)
        self._ingested: Optional[float] = None

    def _counter(self, name: str) -> Optional[float]:
        """A counter of the embedded server's Prometheus ``/metrics`` (None when it has none)."""
        if not self.api:
            return None
        try:
            with urllib.request.urlopen(f"{self.api}/metrics", timeout=10) as response:
                text = response.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None

    def mark(self) -> None:
        self._ingested = self._counter("trainguard_ingest_events_total")

    def caught_up(self) -> bool:
        """Every event the server had queued at :meth:`mark` was processed (its queue is in order)."""
        if self._ingested is None:
            return False
        processed = self._counter("trainguard_processed_events_total")
        return processed is not None and processed >= self._ingested

    def send(self, events: Sequence[Event], timeout: float) -> SendResult:
        return self.transport.send(events, timeout)

    def _get(self, path: str, **params: Any) -> Any:
        assert self.api is not None and self.read_token is not None
        return ReadClient(self.api, self.read_token).get(path, **params)

    def run(self, run_id: str) -> Optional[Dict[str, Any]]:
        if not self.can_report:
            return None
        found: Optional[Dict[str, Any]] = self._get(f"/api/v1/runs/{urllib.parse.quote(run_id, safe='')}")
        return found

    def incidents(self, run_id: str) -> List[Dict[str, Any]]:
        if not self.can_report:
            return []
        page = self._get(f"/api/v1/runs/{urllib.parse.quote(run_id, safe='')}/incidents", limit=500)
        return list(page["items"]) if page else []

    def close(self) -> None:
        self.transport.close()


# ------------------------------------------------------------------------------------------------ local

def default_project(data_dir: Path) -> str:
    """The bootstrap project of ``data_dir`` (from its tokens file), else the configured default."""
    path = data_dir / TOKENS_FILE
    if path.exists():
        try:
            project = json.loads(path.read_text(encoding="utf-8")).get("project")
            if isinstance(project, str) and project:
                return project
        except (OSError, ValueError):
            pass
    return Settings(data_dir=data_dir).bootstrap_project


class LocalBackend(Backend):
    """An in-process gateway + processor over the embedded stores in ``data_dir`` (see the module doc)."""

    can_report = True

    def __init__(self, data_dir: Path, *, project: Optional[str] = None, token: Optional[str] = None) -> None:
        settings = Settings(data_dir=data_dir)
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.stores = open_sqlite_stores(self.data_dir)
        self._closed = False
        try:
            if token:
                info = self.stores.projects.authenticate(token)
                if info is None or info.kind != "ingest":
                    raise ValueError("--token is not an ingest token of this data directory")
                if project and project != info.project:
                    raise ValueError(f"--token belongs to project {info.project!r}, not {project!r}")
                self.auth = info
            else:
                self.auth = TokenInfo(token_id="replay", project=project or default_project(self.data_dir),
                                      kind="ingest", created_ns=time.time_ns(),
                                      description="trainguard replay")
            self.project = self.auth.project
            # the queue as `trainguard serve` opens it on this data dir (lanes, partitions): the detection
            # state replay leaves is then under the partitions a later serve restores
            self.queue = SqliteQueue(self.data_dir / QUEUE_DB, max_depth=settings.max_queue_depth,
                                     retry_after=settings.retry_after_s, lanes=settings.queue_lanes,
                                     partitions=embedded_partitions(settings))
            detection = DetectionSettings.from_overrides(json.loads(settings.detection_overrides or "{}"))
            self.processor = EmbeddedProcessor(self.queue, self.stores.events, self.stores.metrics,
                                               self.stores.incidents, detection,
                                               batch=settings.processor_batch,
                                               round_events=settings.processor_round_events,
                                               snapshot_every_s=settings.snapshot_every_s,
                                               tick_interval_s=NO_TIMERS_S)
            self.gateway = Gateway(self.queue, self.stores.projects, settings)
        except Exception:
            self.stores.close()
            raise
        self.processor.start()
        self.description = f"data dir {self.data_dir} (project {self.project!r})"

    def send(self, events: Sequence[Event], timeout: float) -> SendResult:
        try:
            batch = batch_from_json(encode_batch(events), max_events=self.settings.max_batch_events)
            result = self.gateway.ingest_batch(self.auth, batch)
        except (Backpressure, Unavailable) as exc:
            raise TransportError(str(exc), retryable=True, retry_after=exc.retry_after,
                                 status="429" if isinstance(exc, Backpressure) else "503") from None
        except RequestTooLarge as exc:
            raise TransportError(str(exc), retryable=False, status="413") from None
        except GatewayError as exc:
            raise TransportError(str(exc), retryable=False, status="400") from None
        return SendResult(accepted=result.accepted, duplicates=result.duplicates,
                          rejected=[r.to_dict() for r in result.rejected])

    def finish(self) -> None:
        self.processor.stop(drain=True)

    def caught_up(self) -> bool:
        return not self.processor.alive  # finish() drained the queue

    def run(self, run_id: str) -> Optional[Dict[str, Any]]:
        record = self.stores.incidents.get_run(self.project, run_id)
        return record.to_dict() if record is not None else None

    def incidents(self, run_id: str) -> List[Dict[str, Any]]:
        page = self.stores.incidents.list_incidents(self.project, run_id=run_id, limit=500)
        return [inc.to_dict() for inc in page.items]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.processor.alive:
            self.processor.stop(drain=True)
        self.queue.close()
        self.stores.close()


# --------------------------------------------------------------------------------------------- dry run

class DryRunBackend(Backend):
    """``--dry-run``: counts what would be sent and stores nothing (every envelope "accepted")."""

    description = "nowhere (--dry-run: nothing imported)"
    dry = True

    def send(self, events: Sequence[Event], timeout: float) -> SendResult:
        return SendResult(accepted=len(events), duplicates=0, rejected=[])
