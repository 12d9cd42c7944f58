"""The envelopes the agent sends on its own: what it read in the job's output and saw of its process.

Contract of :class:`EventBuilder`:

* Identity comes from the environment the way the SDK reads it (:func:`trainguard.identity.from_environment`:
  ``TRAINGUARD_RUN_ID``, the launcher's variables, ``RANK`` ...), so the agent's events and the SDK's land in
  the same run and rank; ``sdk = "trainguard-agent/<version>"``.
* Event ids are deterministic, as ``trainguard replay``'s
  (:func:`~trainguard_server.replay.importer.event_id`):
  a log line or traceback by (run, rank, source, first line number); lifecycle and hang reports by (run,
  rank, what, pid / episode). A sidecar that restarts and reads a log file again sends the same ids, which
  the platform keeps once.
* Log lines are ``log`` events with the level found in the line; tracebacks are ``exception`` events
  (``mechanism="log"``, fingerprinted as the SDK would) -- both from :mod:`trainguard_server.replay.logs`.
* A hang report is a ``log`` event from source :data:`HANG_SOURCE` whose first line is
  ``trainguard agent: no progress for <s> s (threshold <s> s = <how>); last step <n>`` followed by the last
  lines of output and the Python stacks; the end of the episode is a log event from
  :data:`PROGRESS_SOURCE`. The pipeline reads both
  (:func:`trainguard_engine.detectors.progress.on_agent_report`).
"""

from __future__ import annotations

import socket
from typing import Any, Dict, List, Mapping, Optional, Sequence

from trainguard.core import events as ev
from trainguard.identity import RunIdentity, from_environment
from trainguard_engine.detectors.progress import HANG_SOURCE, PROGRESS_SOURCE, hang_headline

from .. import __version__
from ..replay.importer import event_id
from ..replay.logs import LogItem
from .watchdog import Hang

SDK = f"trainguard-agent/{__version__}"
Event = Dict[str, Any]
MAX_REPORT_CHARS = 60_000


def agent_identity(env: Mapping[str, str], *, pid: int = 0, run_id: Optional[str] = None) -> RunIdentity:
    """The run identity of the job the agent watches, from ``env`` (its environment, or the job's)."""
    host = socket.gethostname()
    return from_environment(env, pid=pid, host=host, generated_run_id=f"agent-{host}", run_id=run_id)


class EventBuilder:
    def __init__(self, identity: RunIdentity, *, project: str = "") -> None:
        self.identity = identity
        self.project = project
        self.pid = identity.pid

    def base(self, rank: Optional[int] = None) -> Event:
        i = self.identity
        return {"project": self.project, "run_id": i.run_id, "trace_id": i.trace_id, "host": i.host,
                "pid": self.pid, "rank": i.rank if rank is None else rank, "local_rank": i.local_rank,
                "world_size": max(i.world_size, (rank or 0) + 1), "group_rank": i.group_rank,
                "run_name": i.run_name, "sdk": SDK}

    def _id(self, rank: int, source: str, key: str) -> str:
        return event_id(self.identity.run_id, rank, f"agent:{source}", key)

    def log_item(self, item: LogItem, source: str, step: int, time_ns: int, *, id_source: str = "") -> Event:
        """A log line or traceback read from ``source`` ("stdout", "stderr", "file:<name>"); ``id_source``
        names the source in the event id (a file's path and inode: the same lines after a restart)."""
        id_source = id_source or source
        if item.kind == "exception":
            return ev.envelope(self.base(item.rank), "exception", dict(item.payload), step=step,
                               time_unix_nano=time_ns, severity="CRITICAL",
                               event_id=self._id(item.rank, id_source, str(item.line)))
        payload = {"logger": "", "level": item.level, "message": item.message, "source": source}
        return ev.envelope(self.base(item.rank), "log", payload, step=step, time_unix_nano=time_ns,
                           severity=item.level if item.level in ev.SEVERITIES else "INFO",
                           event_id=self._id(item.rank, id_source, str(item.line)))

    def start(self, argv: Sequence[str], time_ns: int, tags: Mapping[str, str]) -> Event:
        payload = {"phase": "START", "argv": [ev.safe_str(a, 1024) for a in list(argv)[:64]],
                   "tags": ev.string_map(dict(self.identity.tags, **tags)), "config": {}}
        return ev.envelope(self.base(), "lifecycle", payload, step=0, time_unix_nano=time_ns,
                           event_id=self._id(self.identity.rank, "start", str(self.pid)))

    def exit(self, code: int, signal: int, reason: str, step: int, time_ns: int) -> Event:
        payload = {"phase": "EXIT", "exit_code": code, "signal": signal, "reason": reason}
        return ev.envelope(self.base(), "lifecycle", payload, step=step, time_unix_nano=time_ns,
                           severity="INFO" if code == 0 and not signal else "ERROR",
                           event_id=self._id(self.identity.rank, "exit", str(self.pid)))

    def hang(self, hang: Hang, episode: int, tail: Sequence[str], stacks: str, stack_method: str) -> Event:
        """The hang report (see the module doc)."""
        lines = [hang_headline(hang.quiet_s, hang.threshold_s, hang.how, hang.last_step), "",
                 f"last {len(tail)} lines of output:"] + [f"  {t}" for t in tail]
        if stacks:
            lines += ["", f"Python stacks ({stack_method}):", stacks]
        else:
            lines += ["", f"Python stacks: not available ({stack_method})"]
        message = "\n".join(lines)
        if len(message) > MAX_REPORT_CHARS:
            message = message[:MAX_REPORT_CHARS - 20] + "\n... (truncated)"
        payload = {"logger": "trainguard.agent", "level": "ERROR", "message": message, "source": HANG_SOURCE}
        return ev.envelope(self.base(), "log", payload, step=max(hang.last_step, -1),
                           time_unix_nano=hang.decided_ns, severity="ERROR",
                           event_id=self._id(self.identity.rank, "hang", f"{self.pid}.{episode}"))

    def resumed(self, hang: Hang, episode: int, time_ns: int, step: int) -> Event:
        quiet = (time_ns - hang.since_ns) / 1e9
        payload = {"logger": "trainguard.agent", "level": "INFO", "source": PROGRESS_SOURCE,
                   "message": f"trainguard agent: progress again after {quiet:.1f} s without"}
        return ev.envelope(self.base(), "log", payload, step=step, time_unix_nano=time_ns, severity="INFO",
                           event_id=self._id(self.identity.rank, "resumed", f"{self.pid}.{episode}"))


__all__: List[str] = ["SDK", "EventBuilder", "agent_identity"]
