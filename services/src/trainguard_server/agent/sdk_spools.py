"""What the SDK of a dead process left in its spool, delivered by the agent: a rank killed by SIGKILL (the
OOM killer, a launcher's grace period), an abort, a native crash, or one that exited while its backend was
down.

Contract of :class:`SdkSpools`:

* ``root`` is an SDK spool directory (``TRAINGUARD_SPOOL_DIR``; in wrapper mode the agent gives its job
  ``<agent spool>/sdk`` unless the job's environment names one). Its layout is the SDK's
  (:mod:`trainguard.transport.home`): ``<root>/<endpoint key>/<one directory per process>``, each locked by
  its live owner. :meth:`deliver` takes every directory whose owner is dead
  (:func:`trainguard.transport.orphans.find_orphans`: its write-ahead events and faulthandler's dump
  sealed into batches) and ingests its batches, oldest first, into the relay's durable queue
  (``ingest``: the local gateway, validated like any SDK request), from where they are forwarded
  upstream; a batch leaves the directory only once queued.
* Only directories whose events were going where the agent forwards are taken: their recorded endpoint
  is on a loopback address (this agent, or an earlier instance of it on another port) or is the agent's
  upstream. Others (another platform, an older SDK's directory without an owner file) are left untouched,
  for the SDK's own next process.
* The relay's queue full (or failing): the directory is let go as it is and taken again next time. A
  batch refused as a whole (malformed, too large) is dropped and counted; events refused one by one are
  counted by the gateway's result. Re-sending what the dead process had sent already is safe: the platform
  keeps each event id once.
* :attr:`counters` says what happened (``sdk_spool_batches``, ``sdk_spool_events``,
  ``sdk_spool_rejected``, ``sdk_spool_dropped``, ``sdk_spool_skipped_dirs``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

from trainguard.core.events import encode_batch
from trainguard.transport.orphans import Orphan, find_orphans

from ..gateway.ingest import Backpressure, Batch, GatewayError, IngestResult, Unavailable, batch_from_json

log = logging.getLogger("trainguard.agent.sdk_spools")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
Ingest = Callable[[Batch], IngestResult]


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` (``http(s)://`` / ``grpc(s)://host:port``) names this host's loopback."""
    try:
        host = urlsplit(endpoint).hostname or ""
    except ValueError:
        return False
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class SdkSpools:
    """Delivers dead SDK processes' spools under ``root`` through ``ingest`` (see the module doc)."""

    def __init__(self, root: Path, upstream: str, ingest: Ingest, max_events: int) -> None:
        self.root = root
        self.upstream = upstream.rstrip("/")
        self.ingest = ingest
        self.max_events = max_events
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # the agent's loop and its end may both call deliver()

    def accepts(self, endpoint: str) -> bool:
        """Whether events that were going to ``endpoint`` are the agent's to forward."""
        return bool(endpoint) and (is_loopback(endpoint) or endpoint.rstrip("/") == self.upstream)

    def _accepts_owner(self, owner: Mapping[str, Any]) -> bool:
        if self.accepts(str(owner.get("endpoint", ""))):
            return True
        self.counters["sdk_spool_skipped_dirs"] += 1
        return False

    def deliver(self) -> int:
        """Ingest every dead process's spool found now; the events queued."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            queued = 0
            for parent in self._parents():
                for orphan in find_orphans(str(parent), accept=self._accepts_owner):
                    try:
                        queued += self._deliver(orphan)
                    finally:
                        orphan.release()
            return queued
        finally:
            self._lock.release()

    def _parents(self) -> Iterable[Path]:
        try:
            return sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError:
            return []

    def _deliver(self, orphan: Orphan) -> int:
        try:
            spool = orphan.spool()
        except OSError as exc:
            log.warning("cannot read the SDK spool %s: %s", orphan.directory, exc)
            return 0
        queued = 0
        while len(spool):
            batch = spool.peek()
            if batch is None:
                break
            try:
                result = self.ingest(batch_from_json(encode_batch(batch), max_events=self.max_events))
            except (Backpressure, Unavailable) as exc:
                log.info("the relay's spool cannot take %s now (%s): later", orphan.directory, exc)
                break
            except GatewayError as exc:  # refused as a whole (malformed, too large): re-sending cannot help
                log.warning("dropping a batch of %d events from %s: %s", len(batch), orphan.directory, exc)
                self.counters["sdk_spool_dropped"] += len(batch)
                spool.pop()
                continue
            spool.pop()
            self.counters["sdk_spool_batches"] += 1
            self.counters["sdk_spool_events"] += result.accepted
            self.counters["sdk_spool_rejected"] += len(result.rejected)
            queued += result.accepted
        if spool.discarded:
            self.counters["sdk_spool_dropped"] += spool.discarded
        if queued:
            log.info("delivered %d events a dead process left in %s", queued, orphan.directory)
        return queued

