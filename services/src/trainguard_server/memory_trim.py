"""Give freed heap memory back to the operating system after a burst (``trainguard serve``, security.md H42).

glibc's allocator keeps the memory a process freed for its own reuse: after a burst -- an HTTP/2 flood of
800 KB header blocks or SETTINGS frames on the gRPC port (gRPC's core allocates for each, before any token is
checked), a batch of big bodies -- ``trainguard serve`` stayed at 0.7-1.1 GB resident for the rest of its
life, though nothing held that memory any more (``malloc_trim(0)`` gave back all but ~250 MB in 0.1-0.2 s).
Memory the process keeps but does not use is memory every tenant's next burst, and the machine's other
processes, no longer have.

:class:`MemoryTrim` checks every ``interval_s`` whether the resident size grew by ``min_growth_bytes`` since
the last give-back, and if so calls ``malloc_trim(0)``. The peak of a burst is not lowered (that is the
bounds' work); what it leaves behind is given back. Only where glibc's ``malloc_trim`` and
``/proc/self/statm`` exist (Linux with glibc); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from typing import Callable, Optional, Tuple

from .config import Settings

__all__ = ["MemoryTrim", "resident_bytes"]

log = logging.getLogger(__name__)

#: defaults of the settings ``memory_trim_interval_s`` and ``memory_trim_min_growth_mb`` (config.py)
INTERVAL_S: float = Settings.model_fields["memory_trim_interval_s"].default
MIN_GROWTH_MB: int = Settings.model_fields["memory_trim_min_growth_mb"].default


def resident_bytes() -> int:
    """This process's resident memory (bytes), from ``/proc/self/statm``; 0 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _glibc_trim() -> Optional[Callable[[], int]]:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


class MemoryTrim:
    """Call :meth:`tick` often (it only looks at the clock between checks); see the module doc."""

    def __init__(self, interval_s: float = INTERVAL_S, min_growth_bytes: int = MIN_GROWTH_MB * 2**20, *,
                 rss: Callable[[], int] = resident_bytes, trim: Optional[Callable[[], int]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.min_growth_bytes = min_growth_bytes
        self._rss = rss
        self._trim = trim if trim is not None else (_glibc_trim() if interval_s > 0 else None)
        self._clock = clock
        self._next = clock() + interval_s
        self.base = rss() if self.enabled else 0  # resident bytes after the last give-back (or at start)
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and self._trim is not None

    def tick(self) -> Optional[Tuple[int, int, float]]:
        """When a check is due and memory grew enough: give back; ``(before, after, seconds)`` then."""
        if not self.enabled:
            return None
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        before = self._rss()
        if before < self.base:
            self.base = before  # memory went back on its own: grow from here
            return None
        if before - self.base < self.min_growth_bytes:
            return None
        assert self._trim is not None
        try:
            self._trim()
        except Exception:  # never let the give-back take the server down
            log.exception("malloc_trim failed; memory give-back turned off")
            self.interval_s = 0
            return None
        took = self._clock() - now
        after = self._rss()
        self.base = after
        self.trims += 1
        log.info("gave %d MB of freed memory back to the OS (resident %d -> %d MB) in %.0f ms",
                 (before - after) >> 20, before >> 20, after >> 20, took * 1000)
        return before, after, took
