"""This process's spool directory: claimed under a lock the kernel drops when the process dies, so that a
later process (or ``trainguard agent``) can tell a dead owner's spool from a live one and deliver it.

Layout of one process's directory ``<spool_dir>/<key>/<run>-rank<r>-pid<p>/`` (``key``: the endpoint and
project, so a directory only ever holds events for one destination):

* ``.lock`` -- ``flock``-ed (exclusive) by the owner for as long as it lives. The kernel releases it at any
  death (SIGKILL included); whoever then gets the lock may deliver the directory (:mod:`.orphans`). The
  directory is built under a hidden staging name with the lock already held and renamed into place, so a
  scanner never sees a live owner's directory unlocked.
* ``.owner`` -- JSON: the envelope identity of the owner (run, rank, pid, host, ...), its ``endpoint`` and
  ``project``: who wrote the directory and where its events were going.
* ``write-ahead.jsonl`` -- urgent events (non-finite alerts, exceptions, the EXIT event), one JSON envelope
  a line, appended synchronously by the thread that produced them *before* the worker sends them
  (:class:`WriteAhead`); emptied once every line was settled (acknowledged, rejected or spooled).
* ``fault.txt`` -- faulthandler's output: the Python stacks of a native crash (SIGSEGV, SIGABRT, ...), which
  no Python code can report once it happened (:mod:`trainguard.integrations.fatal`).
* ``<seq>-<count>.json`` -- spooled batches (:class:`~.spool.DiskSpool`).

No fsync: what a process wrote survives its own death in the page cache; only a machine crash loses it.
Without ``fcntl`` (Windows) or on a file system without locks a directory is claimed without a lock and is
never taken for a dead one's (the spool works as before; a dead process's is not delivered).
"""

from __future__ import annotations

import json
import os
import threading
from typing import IO, Any, Dict, Iterable, Mapping, Optional

from ..core.events import encode_event

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
OWNER_NAME = ".owner"
WRITE_AHEAD_NAME = "write-ahead.jsonl"
FAULT_NAME = "fault.txt"
WRITE_AHEAD_MAX_BYTES = 4 * 1024 * 1024
"""Most bytes ``write-ahead.jsonl`` may hold before it is next emptied; beyond it urgent events are only
queued (as before write-ahead existed). Bounds the file even when something always waits unsettled."""
STAGING_PREFIX = "."
"""Directories whose name starts with this are being built (or were, by a process that died doing it)."""
LOCKING = fcntl is not None
"""Whether a dead owner's directory can be told from a live one here."""


def try_lock(directory: str) -> Optional[int]:
    """Lock ``directory``'s lock file without waiting; its fd (the lock lives as long as it stays open), or
    None when a live process holds it, the directory is gone, or there is no ``fcntl``."""
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def read_owner(directory: str) -> Dict[str, Any]:
    """``.owner`` of ``directory`` ({} when absent or unreadable: a spool of an older SDK)."""
    try:
        with open(os.path.join(directory, OWNER_NAME), encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_owner(directory: str, owner: Mapping[str, Any]) -> None:
    with open(os.path.join(directory, OWNER_NAME), "w", encoding="utf-8") as fh:
        json.dump(dict(owner), fh, ensure_ascii=False)


class WriteAhead:
    """Urgent events on disk before they are sent (``write-ahead.jsonl``, see the module doc).

    ``write`` runs on the producing thread (one ``write`` syscall of a few KiB to the page cache, no
    network, no fsync); at most ``max_pending`` events may wait unsettled and the file holds at most
    ``max_bytes`` -- beyond that they are only queued (``skipped`` counts them). Events of one ``key`` (the
    same alert, the same exception) coalesce: while one is unsettled, :meth:`wants` says no to the next
    (``coalesced`` counts them), so a run that logs NaN every step writes about one alert per delivery.
    ``settle`` runs on the worker once a batch was acknowledged, rejected or spooled; when nothing written
    is unsettled the file is emptied. Never raises: a failing disk turns it off (``failed``).
    """

    def __init__(self, path: str, max_pending: int, max_bytes: int = WRITE_AHEAD_MAX_BYTES) -> None:
        self.path = path
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self._size = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._pending: Dict[str, str] = {}  # event id -> key
        self._keys: Dict[str, str] = {}  # key -> the event id written for it and not settled yet
        self._lock = threading.Lock()
        self.written = 0
        self.skipped = 0
        self.coalesced = 0
        self.failed = ""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wants(self, key: str) -> bool:
        """Whether an event of ``key`` would be written now (cheap: ask before building one)."""
        if self.failed or self._fd < 0:
            return False
        if key and key in self._keys:
            self.coalesced += 1
            return False
        if len(self._pending) >= self.max_pending:
            self.skipped += 1
            return False
        return True

    def write(self, event: Mapping[str, Any], key: str = "") -> bool:
        """Append ``event`` (an envelope with its ``event_id``) of ``key`` ("": none); False when it was not
        written."""
        if self.failed:
            return False
        try:
            line = encode_event(dict(event)) + b"\n"
        except (TypeError, ValueError):
            return False
        with self._lock:
            if len(self._pending) >= self.max_pending or self._size + len(line) > self.max_bytes \
                    or self._fd < 0:
                self.skipped += 1
                return False
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError as exc:
                self.failed = str(exc)
                return False
            self._size += len(line)
            event_id = str(event["event_id"])
            self._pending[event_id] = key
            if key:
                self._keys[key] = event_id
            self.written += 1
        return True

    def settle(self, events: Iterable[Mapping[str, Any]]) -> None:
        """``events`` have an outcome of their own (worker thread); empties the file when none is left."""
        with self._lock:
            if not self._pending:
                return
            for event in events:
                key = self._pending.pop(event.get("event_id", ""), None)
                if key:
                    self._keys.pop(key, None)
            if not self._pending and self._fd >= 0:
                try:
                    os.ftruncate(self._fd, 0)
                    self._size = 0
                except OSError as exc:
                    self.failed = str(exc)

    def close(self) -> None:
        """Close the file; it is removed when empty (nothing unsettled)."""
        with self._lock:
            if self._fd < 0:
                return
            empty = not self._pending
            close_fd(self._fd)
            self._fd = -1
        if empty:
            remove_file(self.path)

    def forget_in_child(self) -> None:
        """In a forked child: the parent's file is not ours (its fd is closed, the file left alone)."""
        with self._lock:
            close_fd(self._fd)
            self._fd = -1
            self._pending = {}
            self._keys = {}
            self.failed = "forked"


class SpoolHome:
    """This process's spool directory (see the module doc), claimed on the first call to :meth:`claim`.

    Thread-safe. ``parent`` is ``<spool_dir>/<key>``, ``name`` the directory's name for this process,
    ``owner`` what goes into ``.owner``. Never raises: a directory that cannot be made leaves
    ``problem`` set and every method a no-op (the worker then spools in memory, as before).
    """

    def __init__(self, parent: str, name: str, owner: Mapping[str, Any], max_write_ahead: int) -> None:
        self.parent = parent
        self.name = name
        self.owner = dict(owner)
        self.max_write_ahead = max_write_ahead
        self.directory: Optional[str] = None
        self.write_ahead: Optional[WriteAhead] = None
        self.problem = ""
        self._lock_fd = -1
        self._fault: Optional[IO[str]] = None
        self._mutex = threading.Lock()

    def claim(self) -> Optional[str]:
        """The directory, made and locked on the first call; None when it cannot be made."""
        if self.directory is not None or self.problem:
            return self.directory
        with self._mutex:
            if self.directory is None and not self.problem:
                try:
                    self._claim()
                except OSError as exc:
                    self.problem = f"cannot make the spool directory under {self.parent}: {exc}"
        return self.directory

    def _claim(self) -> None:
        os.makedirs(self.parent, exist_ok=True)
        name = self.name
        for attempt in range(8):
            final = os.path.join(self.parent, name)
            # a directory of that name is another process's (or a dead one's, pid reuse in a container: the
            # orphan scan delivers it): this process takes another name
            name = f"{self.name}-{os.urandom(3).hex()}"
            if os.path.lexists(final):
                continue
            staging = os.path.join(self.parent, f"{STAGING_PREFIX}{os.path.basename(final)}.new")
            staging += os.urandom(4).hex()
            os.mkdir(staging)
            # a fresh directory nobody else knows: the lock fails only where the file system has none (some
            # NFS mounts); then it is claimed unlocked, and nobody can take it for a dead one's either
            fd = try_lock(staging)
            if fd is None:
                fd = -1
            try:
                _write_owner(staging, self.owner)
                os.rename(staging, final)  # fails when ``final`` appeared meanwhile (not empty: its lock)
            except OSError:
                if fd >= 0:
                    os.close(fd)
                remove_tree(staging)
                if attempt == 7:
                    raise
                continue
            self._claimed(final, fd)
            return
        raise OSError(f"no free directory name for {self.name}")

    def _claimed(self, directory: str, fd: int) -> None:
        self._lock_fd = fd
        if self.max_write_ahead > 0:
            try:
                self.write_ahead = WriteAhead(os.path.join(directory, WRITE_AHEAD_NAME), self.max_write_ahead)
            except OSError as exc:
                self.problem = f"write-ahead file: {exc}"  # the directory still serves the disk spool
        self.directory = directory

    def fault_file(self) -> Optional[IO[str]]:
        """``fault.txt``, opened for faulthandler (kept open until :meth:`close`); None when unavailable."""
        directory = self.claim()
        if directory is None:
            return None
        with self._mutex:
            if self._fault is None:
                try:
                    self._fault = open(os.path.join(directory, FAULT_NAME), "w", encoding="utf-8")
                except OSError:
                    return None
            return self._fault

    def close(self) -> None:
        """Let go of the directory: removed when nothing is left in it for anyone to deliver; otherwise
        unlocked, so that the next process (or the agent) delivers what it holds."""
        with self._mutex:
            directory, self.directory = self.directory, None
            if directory is None:
                return
            if self.write_ahead is not None:
                self.write_ahead.close()
                self.write_ahead = None
            if self._fault is not None:
                try:
                    self._fault.close()
                except OSError:
                    pass
                self._fault = None
                fault = os.path.join(directory, FAULT_NAME)
                if _size(fault) == 0:
                    remove_file(fault)
            if only_bookkeeping(directory):
                remove_tree(directory)
            close_fd(self._lock_fd)  # after the removal: nobody may take it for a dead one's before
            self._lock_fd = -1
            self.problem = "closed"

    def forget_in_child(self, name: str, owner: Mapping[str, Any]) -> None:
        """In a forked child: the parent's directory, lock and files are not ours. The inherited fds are
        closed (the parent's lock stays held: it belongs to the parent's open file); the child claims a
        directory of its own (``name``) when it first needs one."""
        if self.write_ahead is not None:
            self.write_ahead.forget_in_child()
        self.write_ahead = None
        close_fd(self._lock_fd)
        self._lock_fd = -1
        self._fault = None  # the file object is the parent's; closing it here would flush nothing of ours
        self._mutex = threading.Lock()
        self.directory = None
        self.problem = ""
        self.name = name
        self.owner = dict(owner)


def close_fd(fd: int) -> None:
    """Close ``fd`` if it is one (>= 0), whatever it says."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def only_bookkeeping(directory: str) -> bool:
    """Whether ``directory`` holds nothing to deliver (only the lock and the owner file)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return all(name in (LOCK_NAME, OWNER_NAME) for name in names)


def remove_tree(directory: str) -> None:
    """Remove ``directory`` and the plain files in it (never recursing further)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        remove_file(os.path.join(directory, name))
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
