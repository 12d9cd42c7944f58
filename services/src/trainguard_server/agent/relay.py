"""The agent's relay: a local gateway on the pod's loopback that spools to disk and forwards upstream.

Contract:

* **Local ingest** is the platform's own gateway code (:class:`~trainguard_server.gateway.ingest.Gateway`,
  HTTP and gRPC adapters), so the SDK in the training container talks to the agent exactly as it would
  talk to the platform and gets the same per-item validation and the same precise 4xx / status codes.
  Auth: the bearer token must be the agent's own ingest token (the one it forwards with); anything else
  is 401. The relay does not know the token's project, so it leaves ``project`` as sent and the upstream
  gateway scopes it (``project=""`` in :func:`~trainguard_server.gateway.validate.validate_batch`). The
  accepted SDK envelopes, already decoded for validation, are shown to the agent (``observer``).
* **Durable before acknowledged**: accepted events are published to a SQLite queue in the spool
  directory (:class:`~trainguard_server.queue.sqlite.SqliteQueue`, the embedded backend's queue, WAL,
  fsync per its settings) before the SDK gets its 200. When the spool holds ``max_depth`` records the
  local gateway answers 429 with Retry-After and the SDK keeps the batch in its own spool: nothing is
  lost, memory stays bounded.
* **Forwarding**: one thread consumes the queue in order, joins consecutive records into requests of at
  most :data:`MAX_FORWARD_BYTES`, sends them upstream and commits only after the gateway acknowledged
  them, so a crash or restart of the agent re-sends what was not acknowledged (the platform's stores keep
  each event id once). Retryable failures (connection, 429, 5xx, UNAVAILABLE) back off exponentially up
  to ``max_backoff_s`` and honour Retry-After; 401/403 are retried too (a rotated token secret) with a
  loud log line, never dropped; "too large" splits the request (a single event too large for the
  upstream is dropped and counted); any other rejection of a whole request (400 / INVALID_ARGUMENT, which
  the local validation makes unexpected) drops it and counts it. Per-item rejections are counted by code.
* :class:`RelayStats` says what was accepted, forwarded, rejected and what waits.
"""

from __future__ import annotations

import hmac
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, cast

from trainguard.transport.base import TransportError

from ..config import Settings
from ..gateway.ingest import Batch, Gateway, IngestResult, Unauthenticated, join_events, split_events
from ..queue.base import Queue, QueueRecord
from ..queue.sqlite import SqliteQueue
from ..storage.base import ProjectStore, TokenInfo
from .upstream import Upstream

log = logging.getLogger("trainguard.agent.relay")

MAX_FORWARD_BYTES = 4 * 1024 * 1024
AGENT_SDK_PREFIX = "trainguard-agent/"
Observer = Callable[[Any], None]


class RelayGateway(Gateway):
    """A Gateway whose only valid token is the agent's own (no project store). ``observer`` is shown every
    SDK envelope it accepted, as decoded for validation (the agent's progress tracker); envelopes the agent
    made itself (``sdk`` trainguard-agent/...) are not shown."""

    def __init__(self, queue: Queue, token: str, settings: Settings,
                 observer: Optional[Observer] = None) -> None:
        super().__init__(queue, cast(ProjectStore, None), settings)
        self._token = token.encode()
        self.info = TokenInfo(token_id="agent", project="", kind="ingest", created_ns=0)
        self.observer = observer

    def authenticate(self, token: Optional[str]) -> TokenInfo:
        if not token:
            self.stats.add(auth_failures=1)
            raise Unauthenticated("missing bearer token (send 'Authorization: Bearer <ingest token>')")
        if not hmac.compare_digest(token.encode(), self._token):
            self.stats.add(auth_failures=1)
            raise Unauthenticated("this agent relays only its own ingest token (TRAINGUARD_TOKEN)")
        return self.info

    def ingest_batch(self, auth: TokenInfo, batch: Batch, *, index_offset: int = 0,
                     seen: Optional[Set[str]] = None) -> IngestResult:
        result = super().ingest_batch(auth, batch, index_offset=index_offset, seen=seen)
        observer = self.observer
        if observer is not None:
            refused = {r.event_id for r in result.rejected}
            for env in batch.request.events:
                if env.event_id not in refused and not env.sdk.startswith(AGENT_SDK_PREFIX):
                    observer(env)
        return result


@dataclass
class RelayStats:
    forwarded_requests: int = 0
    forwarded_events: int = 0
    upstream_accepted: int = 0
    upstream_duplicates: int = 0
    upstream_rejected: Counter[str] = field(default_factory=Counter)   # per-item, by code
    dropped_requests: int = 0          # whole requests the upstream refused for good
    dropped_events: int = 0
    retries: int = 0
    last_error: str = ""
    last_error_ns: int = 0
    last_ok_ns: int = 0

    def snapshot(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["upstream_rejected"] = dict(self.upstream_rejected)
        return out


class Forwarder:
    """Consumes the spool queue and delivers it upstream (see the module doc). Start/stop from one thread."""

    def __init__(self, queue: Queue, upstream: Upstream, *, timeout_s: float = 10.0,
                 max_backoff_s: float = 30.0,
                 sleep: Callable[[float], Any] = time.sleep) -> None:
        self.queue = queue
        self.upstream = upstream
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.stats = RelayStats()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sleep = sleep

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainguard-agent-forward", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5)
        self.upstream.close()

    @property
    def upstream_ok(self) -> bool:
        return self.stats.last_ok_ns >= self.stats.last_error_ns

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything spooled was delivered (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.queue.depth() == 0 and self._idle.is_set():
                return True
            time.sleep(0.05)
        return self.queue.depth() == 0

    # --------------------------------------------------------------------------------------- loop
    def _run(self) -> None:
        while not self._stop.is_set():
            self._idle.set()
            records = self.queue.consume(64, timeout=0.25)
            if not records:
                continue
            self._idle.clear()
            for group in _groups(records):
                # serialized IngestRequests concatenate into one: their repeated ``events`` append
                if not self._deliver(b"".join(r.value for r in group)):
                    return  # stopping: the rest stays spooled and is handed out again after a restart
                self.queue.commit(group)

    def _deliver(self, raw: bytes) -> bool:
        """Deliver ``raw`` (or drop it for good); False only when stopping before it was delivered."""
        backoff = 0.0
        while True:
            try:
                result = self.upstream.send(raw, self.timeout_s)
            except TransportError as exc:
                self._failed(str(exc))
                if exc.status in ("413", "RESOURCE_EXHAUSTED") and not exc.retryable:
                    return self._split(raw, str(exc))
                final = not exc.retryable and exc.status not in ("401", "403", "UNAUTHENTICATED",
                                                                  "PERMISSION_DENIED")
                if final:
                    events = len(split_events(raw))
                    self.stats.dropped_requests += 1
                    self.stats.dropped_events += events
                    log.error("upstream %s refused %d events for good: %s", self.upstream.url, events, exc)
                    return True
                if exc.status in ("401", "403", "UNAUTHENTICATED", "PERMISSION_DENIED"):
                    log.error("upstream %s refuses the agent's token (%s): events stay spooled; fix "
                              "TRAINGUARD_TOKEN", self.upstream.url, exc)
                backoff = min(self.max_backoff_s, max(0.2, backoff * 2))
                wait = max(backoff * random.uniform(0.8, 1.2), exc.retry_after or 0.0)
                self.stats.retries += 1
                if self._stop.wait(wait):
                    return False
                continue
            stats = self.stats
            stats.last_ok_ns = time.time_ns()
            stats.forwarded_requests += 1
            stats.forwarded_events += result.accepted + result.duplicates + len(result.rejected)
            stats.upstream_accepted += result.accepted
            stats.upstream_duplicates += result.duplicates
            for item in result.rejected:
                stats.upstream_rejected[str(item.get("code", ""))] += 1
            if result.rejected:
                log.warning("upstream rejected %d events, e.g. %s", len(result.rejected),
                            result.rejected[0].get("message"))
            return True

    def _split(self, raw: bytes, reason: str) -> bool:
        parts = split_events(raw)
        if len(parts) == 1:
            self.stats.dropped_requests += 1
            self.stats.dropped_events += 1
            log.error("upstream refuses a single event as too large (%d bytes): %s", len(parts[0]), reason)
            return True
        half = len(parts) // 2
        return self._deliver(join_events(parts[:half])) and self._deliver(join_events(parts[half:]))

    def _failed(self, message: str) -> None:
        if not self.stats.last_error or self.upstream_ok:
            log.warning("upstream %s: %s (spooling, will retry)", self.upstream.url, message)
        self.stats.last_error = message
        self.stats.last_error_ns = time.time_ns()


def _groups(records: Sequence[QueueRecord]) -> List[List[QueueRecord]]:
    """Consecutive records in requests of at most MAX_FORWARD_BYTES (a bigger record alone)."""
    groups: List[List[QueueRecord]] = []
    size = 0
    for record in records:
        if groups and size + len(record.value) <= MAX_FORWARD_BYTES:
            groups[-1].append(record)
            size += len(record.value)
        else:
            groups.append([record])
            size = len(record.value)
    return groups


def open_spool_queue(spool_dir: Path, max_depth: int) -> SqliteQueue:
    """The relay's durable queue in ``spool_dir`` (created)."""
    spool_dir.mkdir(parents=True, exist_ok=True)
    return SqliteQueue(spool_dir / "relay-queue.db", max_depth=max_depth)
