"""The bytes of ingest requests one process holds at once (HTTP bodies, gRPC messages), bounded in all
and per project.

A request body is buffered whole (at most ``max_batch_bytes``, 8 MiB), then decoded in a worker thread, where
its JSON becomes Python objects and protobuf messages: about six times its size at the peak. Nothing else
bounded how many bodies were held together (uvicorn's connections are limited only by the open-files limit):
24 clients of one project each sending a 7.9 MB batch took ``trainguard serve`` from 136 MB to 1.28 GB of
resident memory, and 1.1 GB stayed (the allocator keeps it), for every project's ingest and processor to
share.

Each request takes its body's bytes as they arrive (whatever its framing: a client that declares 8 MiB and
stalls holds only what it sent), and a gzip body the rest of its inflated size once inflated; it gives them
back when answered. A request that would take its project past ``project_max_inflight_bytes`` or the process
past ``ingest_max_inflight_bytes`` is answered 429 with ``Retry-After`` (the SDK retries and spools
meanwhile); a declared ``Content-Length`` that would not fit is refused so before the body is read (a clean
429 the client reads, not one sent while it still uploads). A request is refused only for what the other
requests hold: one of a project holding nothing else is never refused by the project's bound, nor one by the
total while no other is held (a body larger than a bound goes through alone). gRPC messages take the same
bytes from when their call is served until they are queued (``RESOURCE_EXHAUSTED`` + retry-after past it):
before, the ones waiting for one of the ``grpc_workers`` were held uncounted.

No tenant can starve another through the total (hA, stop 40: two projects each stalling 32 MiB of uploads
until the body timeout filled the 64 MiB total, and every other project's ingest was answered 429 for 30 s).
When the total would be passed, a request is still admitted

* if its project holds nothing else: one body (at most ``max_request``, ``max_batch_bytes``) of a project
  with nothing in flight is always admitted;
* or if its project then holds at most its *share* of the total: ``total`` / the number of projects holding
  bytes (itself counted), so the share shrinks as more projects are in flight.

A project over its share is refused (429 naming the total and its share) until its own bodies end, and the
per-project bound holds as before. Memory stays bounded by the number of projects in flight (projects are
created by an admin's token, not by clients), not by the number of requests: a share is checked when a
project takes bytes, and one that took bytes while fewer projects were in flight keeps them, so the j-th
project to fill in turn holds at most max(min(``per_project``, ``total`` / j), ``max_request``) -- at the
defaults about 142 MiB for 8 projects (measured by the stop-40 review: 140-142 MiB), 8 MiB more for each
further one. (An earlier text said ``total`` + projects x ``max_request``: 128 MiB for 8, wrong.)

Used on the event loop and from the worker threads (the gzip step): a lock guards the counts.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

__all__ = ["InflightBytes"]


class InflightBytes:
    """Bytes held per project and in all, against ``total`` and ``per_project`` (0: that bound is off)."""

    def __init__(self, total: int, per_project: int, max_request: int = 0) -> None:
        self.total = total
        self.per_project = per_project
        #: the largest body one request holds (``max_batch_bytes``; 0: unknown, not checked): the size of the
        #: one body a project with nothing in flight is always admitted
        self.max_request = max_request
        self._held: Dict[str, int] = {}
        self._all = 0
        self._lock = threading.Lock()
        #: called (from the thread giving back, outside the lock) after bytes are given back: the gRPC
        #: ingest's Sends waiting for room are granted it then, whichever protocol's request gave it back
        self.listeners: List[Callable[[], None]] = []

    def take(self, project: str, n: int, own: int = 0) -> Optional[str]:
        """Hold ``n`` more bytes for ``project`` (a request already holding ``own``): None when taken, else
        why not (nothing is taken then)."""
        if n <= 0:
            return None
        with self._lock:
            why = self._refusal(project, n, own)
            if why is None:
                self._held[project] = self._held.get(project, 0) + n
                self._all += n
            return why

    def fits(self, project: str, n: int, own: int = 0) -> Optional[str]:
        """Why ``project`` could not take ``n`` more bytes now (None: it could); nothing is taken."""
        with self._lock:
            return self._refusal(project, n, own) if n > 0 else None

    def _refusal(self, project: str, n: int, own: int) -> Optional[str]:
        # what the other requests hold decides: a request alone goes through whatever its size
        mine = self._held.get(project, 0)
        if self.per_project and mine > own and mine + n > self.per_project:
            return (f"project {project!r} has {mine} bytes of ingest requests being read or decoded, at most "
                    f"{self.per_project} may (TRAINGUARD_PROJECT_MAX_INFLIGHT_BYTES)")
        if self.total and self._all > own and self._all + n > self.total:
            if mine <= own and (not self.max_request or own + n <= self.max_request):
                return None  # a project with nothing else in flight: one body always
            projects = len(self._held) + (project not in self._held)
            share = self.total // projects
            if mine + n <= share:
                return None  # within its share of the total
            return (f"this server has {self._all} bytes of ingest requests being read or decoded, at most "
                    f"{self.total} may (TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES), and project {project!r} holds "
                    f"{mine}, past its share {share} (the total / {projects} projects in flight)")
        return None

    def give_back(self, project: str, n: int) -> None:
        """Release ``n`` bytes ``project`` held."""
        if n <= 0:
            return
        with self._lock:
            left = self._held.get(project, 0) - n
            if left > 0:
                self._held[project] = left
            else:
                self._held.pop(project, None)
            self._all = max(0, self._all - n)
        for listener in list(self.listeners):
            listener()

    def held(self, project: Optional[str] = None) -> int:
        """Bytes held by ``project`` (None: by all)."""
        with self._lock:
            return self._all if project is None else self._held.get(project, 0)
