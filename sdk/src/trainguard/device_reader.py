"""Reading device tensors back without letting the GPU hold up the SDK's delivery thread.

Metric values handed over as device tensors (``log(loss=loss)``, ``watch()``'s fused gradient norms) are
copied to the host on a thread of their own. A device-to-host copy waits until the stream has computed
the value; when the stream is stuck -- a collective whose peer never joins, a hung kernel -- it waits
forever. Done on the delivery thread, that wait would stop the heartbeats and every other event of the
rank (its exceptions, its exit): a rank that is alive but stuck in NCCL would look dead, and whatever it
had queued would be lost when the launcher kills it. (Recorded on two H200s: a DDP rank whose peer was
SIGKILLed sent nothing more, heartbeats included, until torchrun killed it.)

Contract of :class:`DeviceReader`:

* :meth:`submit` takes a batch of queue items that hold device tensors, in queue order; the reader's
  thread (started on first use, a daemon) resolves them with ``resolve(items)`` (which replaces the
  tensors by floats in place and must not raise) and keeps the results.
* :meth:`collect` returns every batch resolved so far, in submission order, waiting at most ``wait_s``
  for the oldest one; it never blocks longer, whatever the device does.
* While a read is stuck, new batches queue behind it; more than ``max_items`` items waiting are dropped
  oldest first and counted by the caller through the returned number (:meth:`submit`).
* :meth:`waiting_s` is how long the current read has been waiting (0.0 when idle): a rank whose reads
  wait for seconds has a stuck device stream.
* :meth:`pending` counts items submitted and not yet collected. After ``fork()`` (:meth:`reset`) the
  child starts empty, with no thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

Item = Tuple[Any, ...]
Resolve = Callable[[List[Item]], List[Item]]


class DeviceReader:
    """A single reader thread for device-to-host metric copies (see the module doc)."""

    def __init__(self, resolve: Resolve, max_items: int) -> None:
        self._resolve = resolve
        self._max_items = max(1, max_items)
        self.reset()

    def reset(self) -> None:
        """Forget everything (a forked child: the parent's thread and batches are not ours)."""
        self._cond = threading.Condition()
        self._todo: Deque[List[Item]] = deque()
        self._done: Deque[List[Item]] = deque()
        self._busy_since = 0.0
        self._in_flight = 0
        self._thread: Optional[threading.Thread] = None

    # --- the delivery thread's side -----------------------------------------------------------
    def submit(self, items: List[Item]) -> int:
        """Queue ``items`` for reading; returns how many waiting items were dropped to stay bounded."""
        if not items:
            return 0
        dropped = 0
        with self._cond:
            self._todo.append(items)
            waiting = sum(len(b) for b in self._todo)
            while waiting > self._max_items and len(self._todo) > 1:
                oldest = self._todo.popleft()
                dropped += len(oldest)
                waiting -= len(oldest)
            self._cond.notify_all()
        self._ensure_thread()
        return dropped

    def collect(self, wait_s: float) -> List[Item]:
        """Every resolved item so far, in submission order; waits up to ``wait_s`` while reads are
        outstanding and nothing is resolved yet."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            while not self._done and (self._todo or self._in_flight):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            out: List[Item] = []
            while self._done:
                out.extend(self._done.popleft())
            return out

    def pending(self) -> int:
        with self._cond:
            return (sum(len(b) for b in self._todo) + sum(len(b) for b in self._done)
                    + self._in_flight)

    def waiting_s(self) -> float:
        """Seconds the current read has been waiting for the device (0.0 when idle)."""
        since = self._busy_since
        return time.monotonic() - since if since else 0.0

    # --- the reader thread --------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="trainguard-device-reader", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo:
                    self._cond.wait()
                batch = self._todo.popleft()
                self._in_flight = len(batch)
                self._busy_since = time.monotonic()
            try:
                resolved = self._resolve(batch)
            except Exception:  # resolve() must not raise; if it does, the batch is lost, not the thread
                resolved = []
            with self._cond:
                self._busy_since = 0.0
                self._in_flight = 0
                self._done.append(resolved)
                self._cond.notify_all()
