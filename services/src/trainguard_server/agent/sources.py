"""Where the job's output comes from: the child's pipes (wrapper mode) or log files (sidecar mode).

* :class:`PipePump` reads a pipe in chunks, writes every byte through to ``passthrough`` unchanged and as
  soon as it arrives (the job's console output is untouched, partial lines included), and hands complete
  lines to ``on_line(number, text)``. A line longer than ``max_line_bytes`` is handed on in pieces.
* :class:`FileFollower` follows the files matching glob patterns (new files are picked up as they
  appear), from their beginning, like ``tail -F``: a file that shrinks was truncated and is read again
  from the start; a path whose inode changed was rotated: the old file is read to its end first. Lines
  are handed on when complete; a last line without a newline is handed on once the file has not grown
  for ``partial_after_s``.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence

LineHandler = Callable[[int, str], None]
CHUNK = 65536
MAX_LINE_BYTES = 1 << 20


class _Lines:
    """Bytes in, numbered lines out."""

    def __init__(self, on_line: LineHandler, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.on_line = on_line
        self.buffer = b""
        self.number = 0
        self.max_line_bytes = max_line_bytes

    def feed(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            self._emit(buffer[start:end])
            start = end + 1
        rest = buffer[start:]
        while len(rest) > self.max_line_bytes:
            self._emit(rest[:self.max_line_bytes])
            rest = rest[self.max_line_bytes:]
        self.buffer = rest

    def finish(self) -> None:
        if self.buffer:
            self._emit(self.buffer)
            self.buffer = b""

    def _emit(self, raw: bytes) -> None:
        self.number += 1
        self.on_line(self.number, raw.decode("utf-8", "replace"))


class PipePump:
    """Copies ``fd`` to ``passthrough`` (a file descriptor, or None) and splits it into lines."""

    def __init__(self, fd: int, passthrough: Optional[int], on_line: LineHandler, name: str) -> None:
        self.fd = fd
        self.passthrough = passthrough
        self.lines = _Lines(on_line)
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, name=f"trainguard-agent-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: Optional[float] = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.fd, CHUNK)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self.bytes += len(data)
                if self.passthrough is not None:
                    _write_all(self.passthrough, data)
                self.lines.feed(data)
        finally:
            self.lines.finish()
            try:
                os.close(self.fd)
            except OSError:
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # our own stdout is gone (closed pipe): keep capturing, stop echoing
        view = view[written:]


@dataclass
class _Followed:
    path: str
    inode: int
    offset: int
    lines: _Lines
    fh: BinaryIO
    grown_ns: int


class FileFollower:
    """Follows the files matching ``patterns`` on a thread; ``on_line(key, number, text)`` with ``key`` =
    ``<path>@<inode>`` (a rotated file's successor numbers its lines from 1 again under a new key)."""

    def __init__(self, patterns: Sequence[str], on_line: Callable[[str, int, str], None], *,
                 poll_s: float = 0.2, partial_after_s: float = 1.0) -> None:
        self.patterns = list(patterns)
        self.on_line = on_line
        self.poll_s = poll_s
        self.partial_after_ns = int(partial_after_s * 1e9)
        self.files: Dict[str, _Followed] = {}
        self.bytes = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainguard-agent-files", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Read what is there one last time, then stop."""
        self._stop.set()
        self.thread.join(timeout=10)

    def paths(self) -> List[str]:
        return sorted(self.files)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.poll()
            if stopping:
                for followed in self.files.values():
                    followed.lines.finish()
                return
            self._stop.wait(self.poll_s)

    def poll(self) -> None:
        """One pass: discover files, read what was appended."""
        for pattern in self.patterns:
            for path in sorted(glob.glob(pattern)):
                if path not in self.files and os.path.isfile(path):
                    self._open(path)
        for followed in list(self.files.values()):
            self._read(followed)

    def _open(self, path: str) -> Optional[_Followed]:
        try:
            fh = open(path, "rb")
            inode = os.fstat(fh.fileno()).st_ino
        except OSError:
            return None
        key = f"{path}@{inode}"
        followed = _Followed(path, inode, 0, _Lines(lambda n, t: self.on_line(key, n, t)), fh,
                             time.monotonic_ns())
        self.files[path] = followed
        return followed

    def _read(self, followed: _Followed) -> None:
        fh = followed.fh
        try:
            size = os.fstat(fh.fileno()).st_size
        except OSError:
            return
        if size < followed.offset:  # truncated: start again
            followed.lines.finish()
            fh.seek(0)
            followed.offset = 0
            followed.lines = _Lines(followed.lines.on_line)
        grew = False
        while True:
            data = fh.read(CHUNK)
            if not data:
                break
            grew = True
            followed.offset += len(data)
            self.bytes += len(data)
            followed.lines.feed(data)
        now = time.monotonic_ns()
        if grew:
            followed.grown_ns = now
        elif followed.lines.buffer and now - followed.grown_ns >= self.partial_after_ns:
            followed.lines.finish()
        try:
            inode = os.stat(followed.path).st_ino
        except OSError:
            inode = followed.inode  # removed: keep what we have open until a new file appears
        if inode != followed.inode and not grew:  # rotated, and the old file is read to its end
            followed.lines.finish()
            fh.close()
            del self.files[followed.path]
            self._open(followed.path)
