"""Spools of dead processes: found by their released lock (:mod:`.home`), sealed into plain batches, and
handed to whoever delivers them -- the worker of a later SDK process, or ``trainguard agent``.

Contract:

* :func:`find_orphans` ``(parent, own, accept)`` returns every process directory in ``parent`` (one
  endpoint and project) whose lock it could take -- its owner is dead, however it died -- other than
  ``own``, and whose owner record ``accept`` takes (default: all; a refused one is not touched). Each is
  returned **locked**: nobody else delivers it until :meth:`Orphan.release`. A staging directory left by a
  process that died while claiming one holds nothing and is removed.
* Before it is returned an orphan is **sealed**: the lines of its write-ahead file and its fault file (as
  one event, :func:`trainguard.crash.fault_event`) are appended as ordinary batch files after the ones it
  already holds, then those two files are removed. Killed half-way, a sealer leaves both copies; the next
  one sends the same event ids again, which the platform keeps once. An event both written ahead and
  spooled by its owner is sent twice for the same reason, and kept once.
* :meth:`Orphan.spool` is a :class:`~.spool.DiskSpool` over the sealed directory (its events are its
  ``inherited``); :meth:`Orphan.release` unlocks it and removes it when nothing to deliver is left.
* Nothing here raises an ``OSError``: an unreadable directory is skipped (and found again next time).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..core.events import decode_events
from ..crash import fault_event
from .home import (
    FAULT_NAME,
    LOCKING,
    STAGING_PREFIX,
    WRITE_AHEAD_NAME,
    close_fd,
    only_bookkeeping,
    read_owner,
    remove_file,
    remove_tree,
    try_lock,
)
from .spool import DiskSpool, SpoolError

BATCH_EVENTS = 500
"""Most events per batch file a seal writes (the write-ahead file can hold thousands of lines)."""


@dataclass
class Orphan:
    """A dead process's spool directory, locked by us (see the module doc)."""

    directory: str
    owner: Dict[str, Any] = field(default_factory=dict)
    lock_fd: int = -1

    @property
    def endpoint(self) -> str:
        return str(self.owner.get("endpoint", ""))

    def spool(self) -> DiskSpool:
        """The sealed directory as a spool (raises OSError like :class:`DiskSpool`)."""
        return DiskSpool(self.directory, sys.maxsize)

    def release(self) -> None:
        """Unlock; the directory is removed first when it holds nothing left to deliver."""
        if only_bookkeeping(self.directory):
            remove_tree(self.directory)
        close_fd(self.lock_fd)
        self.lock_fd = -1


def find_orphans(parent: str, own: Optional[str] = None,
                 accept: Callable[[Mapping[str, Any]], bool] = lambda owner: True) -> List[Orphan]:
    """The dead processes' directories in ``parent``, locked and sealed (see the module doc)."""
    if not LOCKING:
        return []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    found: List[Orphan] = []
    for name in names:
        path = os.path.join(parent, name)
        if own is not None and os.path.abspath(path) == os.path.abspath(own):
            continue
        if not os.path.isdir(path):
            continue
        fd = try_lock(path)
        if fd is None:
            continue  # its owner lives (or it is gone)
        if name.startswith(STAGING_PREFIX):
            remove_tree(path)
            os.close(fd)
            continue
        orphan = Orphan(path, read_owner(path), fd)
        if not accept(orphan.owner):
            os.close(fd)
            continue
        try:
            seal(orphan)
        except (OSError, SpoolError):
            orphan.release()
            continue
        found.append(orphan)
    return found


def seal(orphan: Orphan) -> int:
    """Turn ``orphan``'s write-ahead lines and fault file into batch files; the events added."""
    directory = orphan.directory
    spool = DiskSpool(directory, sys.maxsize)
    added = 0
    ahead = os.path.join(directory, WRITE_AHEAD_NAME)
    events = read_write_ahead(ahead)
    for start in range(0, len(events), BATCH_EVENTS):
        spool.append(events[start:start + BATCH_EVENTS])
    added += len(events)
    remove_file(ahead)
    fault = os.path.join(directory, FAULT_NAME)
    try:
        with open(fault, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        written_ns = os.stat(fault).st_mtime_ns
    except OSError:
        text, written_ns = "", 0
    if text.strip():
        # the crash came after everything written ahead; the file's mtime alone may read earlier (the
        # kernel stamps files from a coarse clock)
        last_step = max((e["step"] for e in events if isinstance(e.get("step"), int)), default=-1)
        last_ns = max((e["time_unix_nano"] for e in events if isinstance(e.get("time_unix_nano"), int)),
                      default=0)
        spool.append([fault_event(text, orphan.owner, key=os.path.basename(directory),
                                  time_ns=max(written_ns, last_ns + 1), step=last_step)])
        added += 1
    remove_file(fault)
    return added


def read_write_ahead(path: str) -> List[Dict[str, Any]]:
    """The envelopes in a write-ahead file, in order; lines that do not parse (torn by a death in the
    middle of a write) are skipped."""
    try:
        with open(path, "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    events: List[Dict[str, Any]] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            (event,) = decode_events(b'{"events":[' + line + b"]}")
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event_id"):
            events.append(event)
    return events
