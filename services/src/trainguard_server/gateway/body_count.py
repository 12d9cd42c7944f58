"""How many HTTP ingest bodies each project has being read at once (security.md H43).

A body is read as it arrives, and the only limit on its pace is ``http_body_timeout_s`` (30 s) *between*
bytes: a client sending one byte every 29 s holds its connection, its request task and its place in the
uvicorn server for as long as it goes on. The bound on ingest bytes in flight (:mod:`.inflight`) counts what
such bodies hold, which is next to nothing, so nothing bounded how many one project kept open: one tenant's
trickled uploads took the server's descriptors (stop 44: 1,100 of them against a server with an open-files
limit of 1,024, and another project's ingest failed for as long as they trickled).

:class:`ProjectBodies` counts a project's bodies from when its request is authenticated until its body is
read (or given up); one more than ``limit`` is refused before anything of it is read -- the HTTP layer answers
429 with ``Retry-After`` and ``Connection: close``, so the refused connection is not kept either. A tenant's
slow bodies then cost only that tenant's own ingest. A project with fewer bodies in flight than the bound
never notices it: an honest body on a LAN is read in milliseconds, so even a big fleet sending at once has a
handful being read at any instant (and its bytes are bounded by ``project_max_inflight_bytes`` anyway).

Used on the event loop only; a lock keeps it right if that ever changes.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

from ..config import Settings

__all__ = ["DEFAULT_LIMIT", "SETTING", "ProjectBodies"]

SETTING = "project_max_http_bodies"
DEFAULT_LIMIT: int = Settings.model_fields[SETTING].default


class ProjectBodies:
    """Per-project count of HTTP ingest bodies being read; ``limit`` 0: not bounded (still counted)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, project: str) -> Optional[str]:
        """Count one more body of ``project``; None when it may be read, else why not (nothing counted)."""
        with self._lock:
            n = self._counts.get(project, 0)
            if self.limit and n >= self.limit:
                return (f"project {project!r} has {n} HTTP ingest bodies being read at once, the most "
                        f"{SETTING}={self.limit} (TRAINGUARD_{SETTING.upper()}) allows; bodies sent slowly "
                        f"hold their turn until they end")
            self._counts[project] = n + 1
            return None

    def leave(self, project: str) -> None:
        """One body of ``project`` read or given up."""
        with self._lock:
            n = self._counts.get(project, 0) - 1
            if n > 0:
                self._counts[project] = n
            else:
                self._counts.pop(project, None)

    def reading(self, project: str) -> int:
        """``project``'s bodies being read now."""
        with self._lock:
            return self._counts.get(project, 0)
