"""Native crashes -- SIGSEGV, SIGABRT (``os.abort()``, a C++ ``std::terminate``), SIGBUS, SIGFPE, SIGILL: the
Python stacks at the moment of the signal, kept in the process's spool directory for the next process or
``trainguard agent`` to deliver.

Once such a signal arrives no Python code runs again: a Python handler would run at the next bytecode, which
never comes (``abort()`` re-raises with the default action as soon as a handler returns). So what must
survive is written before or by C code: urgent events are written ahead of sending
(:class:`~trainguard.transport.home.WriteAhead`), and faulthandler's C handler writes the crashing thread's
stack into ``fault.txt`` (:mod:`trainguard.transport.home`), from where :mod:`trainguard.crash` makes an
event of it.

Contract:

* :func:`enable` turns faulthandler on into the given file, unless it is already on -- the user's,
  ``PYTHONFAULTHANDLER`` or ``-X faulthandler``: theirs stays as it is (printing to stderr, where
  ``trainguard agent`` reads it). Returns whether it did.
* Only the crashing thread's stack is written. Walking the other threads' frames while they run (a C++
  ``std::terminate`` or a native call releases the GIL, and the SDK's own threads keep running) can crash
  the handler itself: with every thread dumped, 1 of 30 ``std::terminate`` runs here ended in SIGSEGV
  instead of SIGABRT -- a different exit status than without the SDK.
* Neither the output nor the end of the process changes: the dump goes to the file, not to stderr, and
  faulthandler then re-raises the signal with the disposition it had (exit status 134 for an abort, ...).
* :func:`disable` turns it off if it is still the SDK's; a forked child (DataLoader worker) turns it off at
  once: its crash would otherwise land in the parent's file, under the parent's identity.
"""

from __future__ import annotations

import faulthandler
import os
from typing import IO, Optional

_ours: Optional[IO[str]] = None
_fork_hook = False


def enable(file: IO[str]) -> bool:
    """faulthandler into ``file`` unless someone turned it on already (see the module doc)."""
    global _ours, _fork_hook
    if faulthandler.is_enabled():
        return _ours is not None and _ours is file
    try:
        faulthandler.enable(file=file, all_threads=False)
    except (OSError, ValueError, RuntimeError):
        return False
    _ours = file
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=disable)
        _fork_hook = True
    return True


def disable() -> None:
    """Turn faulthandler off if the SDK turned it on (and nobody re-enabled it since, as far as we know)."""
    global _ours
    if _ours is None:
        return
    _ours = None
    try:
        faulthandler.disable()
    except Exception:
        pass


def is_ours() -> bool:
    """Whether faulthandler is on into the SDK's file."""
    return _ours is not None and faulthandler.is_enabled()
