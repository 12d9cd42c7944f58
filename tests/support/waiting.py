"""Waiting for something a background process does."""

from __future__ import annotations

import time
from typing import Any, Callable


def poll(fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.1) -> Any:
    """``fn()``'s first truthy value, called every ``interval`` s for up to ``timeout`` s (None after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(interval)
    return None
