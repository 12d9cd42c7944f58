"""At most one log line per window for a failure that can repeat per request (a burst must not fill the log
that every tenant shares), counting the occurrences each line stands for."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable


class LogWindow:
    """Counts a recurring failure; :meth:`due` says when a line is due and how many it reports. Thread-safe;
    ``clock`` (monotonic seconds) may be replaced (tests)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._logged = -math.inf
        self._since = 0
        self._lock = threading.Lock()

    def due(self) -> int:
        """Count one occurrence; when ``every_s`` passed since the last line, the occurrences since then (this
        one included) -- log one line for them -- else 0 (log nothing)."""
        with self._lock:
            self._since += 1
            now = self.clock()
            if now - self._logged < self.every_s:
                return 0
            count, self._since, self._logged = self._since, 0, now
            return count
