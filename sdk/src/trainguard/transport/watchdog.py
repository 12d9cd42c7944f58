"""A deadline for a whole blocking socket exchange, and a way to cut it short from another thread.

Per-operation socket timeouts bound each read or write; they cannot bound a request against a peer that
sends one byte just before each read would time out, and they cannot be shortened by another thread.
:class:`SocketWatchdog` can: while a socket is armed, its thread shuts the socket down when the deadline
passes (or at once on :meth:`fire`), which wakes whatever blocks on it with an error. The owner then asks
:attr:`fired` why its exchange failed: ``"timeout"`` (the deadline) or ``"aborted"`` (:meth:`fire`).

One daemon thread per watchdog, started on first use, idle while nothing is armed, ended by :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Iterator, Optional


class SocketWatchdog:
    """Shuts an armed socket down at its deadline, or on demand (see the module doc)."""

    def __init__(self, name: str = "trainguard-deadline") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._sock: Optional[socket.socket] = None
        self._deadline = 0.0
        self._fired: Optional[str] = None
        self._stopped = False
        self._running = False  # a thread serves this watchdog (changed under the lock only)
        self._pid = 0

    @property
    def fired(self) -> Optional[str]:
        """Why the last armed socket was shut down (``"timeout"`` / ``"aborted"``), or None."""
        return self._fired

    @contextlib.contextmanager
    def guard(self, sock: socket.socket, deadline: float) -> Iterator[None]:
        """Arm ``sock`` until ``deadline`` (time.monotonic()) for the duration of the block."""
        self.arm(sock, deadline)
        try:
            yield
        finally:
            self.disarm()

    def arm(self, sock: socket.socket, deadline: float) -> None:
        with self._cond:
            self._sock, self._deadline, self._fired, self._stopped = sock, deadline, None, False
            self._cond.notify_all()
            if self._running and self._pid == os.getpid():
                return
            self._running, self._pid = True, os.getpid()  # (a forked child has no thread: start one)
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def disarm(self) -> None:
        with self._cond:
            self._sock = None
            self._cond.notify_all()

    def fire(self, reason: str = "aborted") -> None:
        """Shut the armed socket down now (no-op when nothing is armed); thread-safe."""
        with self._cond:
            self._shutdown(reason)

    def stop(self) -> None:
        """End the thread (it is started again by the next :meth:`arm`)."""
        with self._cond:
            self._sock, self._stopped = None, True
            self._cond.notify_all()

    def _shutdown(self, reason: str) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._fired = reason
        try:  # the plain socket's shutdown, also for an SSLSocket: wakes a blocked read/write at once
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def _run(self) -> None:
        with self._cond:
            try:
                while not self._stopped:
                    if self._sock is None:
                        self._cond.wait()
                        continue
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0:
                        self._shutdown("timeout")
                        continue
                    self._cond.wait(remaining)
            finally:
                self._running = False
