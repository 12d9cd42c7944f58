"""SIGTERM while the main thread is stuck in native code: end the process as it would end without the SDK.

The SDK reports a SIGTERM with a Python handler (``exit.py``), then re-raises it with the default
disposition. A Python handler runs only when the main thread next executes bytecode. A rank stuck inside
native code -- a CUDA synchronisation behind a hung NCCL collective, an NCCL call waiting for a dead peer --
never does: with the SDK's handler installed it survives the launcher's SIGTERM until the launcher's grace
period ends in SIGKILL (recorded on two H200s: torchrun had to SIGKILL the survivor of a killed rank 30 s
later), where without the SDK the default disposition would have ended it at once.

:class:`StuckSignalWatch` closes that gap. Python writes the number of every signal it catches to the
"wakeup fd" (``signal.set_wakeup_fd``) from its C-level handler, whatever the main thread is doing; a daemon
thread reads that pipe. When SIGTERM arrives and the Python handler has not started within
:data:`GRACE_S`, the watch calls ``on_stuck(signum)`` on its own thread (the SDK reports the exit there),
then restores the default disposition with libc's ``signal()`` (Python's ``signal.signal`` only works on
the main thread) and sends the signal again: the kernel ends the process "killed by SIGTERM", as without
the SDK.

Contract and limits:

* Installed only from the main thread, only when the disposition it guards was the default (a handler of
  the user's or launcher's decides for itself; stuck, it would not run without the SDK either), and only
  when no wakeup fd is set (asyncio and others use it; theirs is left alone and the watch stays off).
* It acts only if the SDK's own handler is still the installed one when the grace ends (a handler
  installed later by the user wins).
* The pipe's ends are non-inheritable; in a forked child (DataLoader workers) the wakeup fd is cleared and
  the pipe closed, so a child's signals never reach the parent's watch.
* :meth:`stop` (main thread) clears the wakeup fd if it is still ours; the thread exits when the pipe closes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Callable, Optional, Set

GRACE_S = 1.0
"""How long the watch waits for the Python handler to start before it treats the main thread as stuck in
native code. Without the SDK the process would have ended at once; a second keeps the normal path for a
main thread that is merely inside a short native call."""


def _default_disposition(signum: int) -> bool:
    """Set ``signum`` to SIG_DFL at the C level from any thread (True on success)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        result = libc.signal(signum, None)  # NULL == SIG_DFL
        return bool(result != ctypes.c_void_p(-1).value)
    except Exception:
        return False


_ACTIVE: Set[StuckSignalWatch] = set()
_FORK_HOOK = False


def _after_fork_in_child() -> None:
    for watch in list(_ACTIVE):
        watch.forget_in_child()


class StuckSignalWatch:
    """Watches for ``signum`` arriving while the main thread cannot run its handler (see the module doc)."""

    def __init__(self, signum: int, is_ours: Callable[[], bool], on_stuck: Callable[[int], None],
                 grace_s: float = GRACE_S) -> None:
        self.signum = signum
        self._is_ours = is_ours
        self._on_stuck = on_stuck
        self._grace_s = grace_s
        self._handled = threading.Event()
        self._read_fd = -1
        self._write_fd = -1
        self._thread: Optional[threading.Thread] = None

    @property
    def active(self) -> bool:
        return self._write_fd >= 0

    def start(self) -> bool:
        """Install the wakeup fd and the reader thread (main thread only); False when it cannot."""
        if threading.current_thread() is not threading.main_thread() or self.active:
            return False
        read_fd, write_fd = os.pipe()  # non-inheritable (PEP 446)
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read_fd)
            os.close(write_fd)
            return False
        if previous != -1:  # someone else's: put it back and stay off
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._read_fd, self._write_fd = read_fd, write_fd
        global _FORK_HOOK
        if not _FORK_HOOK:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOK = True
        _ACTIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="trainguard-signal-watch", daemon=True)
        self._thread.start()
        return True

    def handled(self) -> None:
        """The Python handler started: the normal path takes it from here."""
        self._handled.set()

    def stop(self) -> None:
        """Clear the wakeup fd if it is still ours (main thread) and close the pipe."""
        if not self.active or threading.current_thread() is not threading.main_thread():
            return  # off the main thread the wakeup fd cannot be cleared, so the pipe must stay open
        try:
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, self._write_fd):
                signal.set_wakeup_fd(current)
        except (ValueError, OSError):
            return
        self._close()

    def _close(self) -> None:
        _ACTIVE.discard(self)
        for fd in (self._write_fd, self._read_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = -1

    def forget_in_child(self) -> None:
        """In a forked child: the parent's pipe and thread are not ours; signals stay the child's. The
        pipe is closed only once Python no longer writes to it (a closed fd number could be reused)."""
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            _ACTIVE.discard(self)
            return
        self._close()
        self._thread = None

    def _run(self) -> None:
        read_fd = self._read_fd
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if self.signum not in data:
                continue
            if self._handled.wait(self._grace_s) or not self._is_ours():
                continue
            try:
                self._on_stuck(self.signum)
            finally:
                if _default_disposition(self.signum):
                    os.kill(os.getpid(), self.signum)
                else:  # no libc signal(): end as the shell reports a death by this signal
                    os._exit(128 + self.signum)
