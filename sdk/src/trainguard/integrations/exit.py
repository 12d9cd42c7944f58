"""Exit capture: uncaught exceptions (main and other threads), ``sys.exit``, SIGTERM and interpreter exit.

What the user sees does not change: the original ``sys.excepthook`` / ``threading.excepthook`` still print
exactly what they printed, and the process exits with the code it would have had without the SDK (a
SIGTERM with the default disposition is re-raised after the exit event is flushed, so the parent still
sees "killed by signal 15"; a main thread stuck in native code, which cannot run a Python handler, is
ended the same way from a watch thread: ``signal_watch.py``).

Exit code bookkeeping: an uncaught exception means 1 (KeyboardInterrupt: 130, Python re-raises SIGINT);
``sys.exit(n)`` records n; otherwise 0. ``raise SystemExit(n)`` without ``sys.exit`` and ``os._exit`` are
invisible from inside the process — the sidecar agent sees those.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Type

from ..guard import warn_once
from .base import Integration
from .signal_watch import StuckSignalWatch

if TYPE_CHECKING:
    from ..client import Client

CAUGHT_SIGNALS = ("SIGTERM",)


class ExitIntegration(Integration):
    """Records how the process ends and reports it as a lifecycle EXIT event, flushed within a bound."""

    identifier = "exit"

    def __init__(self) -> None:
        self._client: Optional[Client] = None
        self.exit_code = 0
        self.signal = 0
        self.reason = "normal"
        self._reported = False
        self._lock = threading.Lock()
        self._prev_excepthook: Optional[Callable[..., Any]] = None
        self._prev_threading_hook: Optional[Callable[..., Any]] = None
        self._prev_exit: Optional[Callable[..., Any]] = None
        self._prev_handlers: Dict[int, Any] = {}
        self._watch: Optional[StuckSignalWatch] = None

    def setup(self, client: Client) -> None:
        self._client = client
        if client.options.capture_uncaught:
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            self._prev_threading_hook = threading.excepthook
            threading.excepthook = self._threading_hook
        if not client.options.capture_exit:
            return
        self._prev_exit = sys.exit
        sys.exit = self._sys_exit  # type: ignore[assignment]
        atexit.register(self._atexit)
        if threading.current_thread() is not threading.main_thread():
            warn_once("signals", "init() outside the main thread: SIGTERM will not be reported")
            return
        for name in CAUGHT_SIGNALS:
            signum = getattr(signal, name)
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            self._prev_handlers[signum] = previous
            signal.signal(signum, self._on_signal)
            if previous in (signal.SIG_DFL, None) and self._watch is None:
                watch = StuckSignalWatch(signum, self._handler_installed(signum), self._on_stuck)
                self._watch = watch if watch.start() else None

    def teardown(self) -> None:
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if self._prev_threading_hook is not None and threading.excepthook == self._threading_hook:
            threading.excepthook = self._prev_threading_hook
        if self._prev_exit is not None and sys.exit == self._sys_exit:
            sys.exit = self._prev_exit  # type: ignore[assignment]
        atexit.unregister(self._atexit)
        if threading.current_thread() is threading.main_thread():
            if self._watch is not None:
                self._watch.stop()
                self._watch = None
            for signum, previous in self._prev_handlers.items():
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, previous)
        self._prev_handlers.clear()
        self._client = None

    # --- hooks ----------------------------------------------------------------------------------
    def _excepthook(self, exc_type: Type[BaseException], exc: BaseException,
                    tb: Optional[TracebackType]) -> None:
        try:
            if issubclass(exc_type, KeyboardInterrupt):
                self._record(130, signal.SIGINT, "signal")
            else:
                self._record(1, 0, "exception")
            client = self._client
            if client is not None:
                if exc.__traceback__ is None and tb is not None:
                    exc = exc.with_traceback(tb)
                client.capture_exception(exc, handled=False, mechanism="excepthook")
        except Exception:
            pass
        previous = self._prev_excepthook or sys.__excepthook__
        previous(exc_type, exc, tb)

    def _threading_hook(self, args: Any) -> None:
        try:
            client = self._client
            exc = args.exc_value
            if client is not None and exc is not None and not isinstance(exc, SystemExit):
                client.capture_exception(exc, handled=False, mechanism="threading")
        except Exception:
            pass
        previous = self._prev_threading_hook or threading.__excepthook__
        previous(args)

    def _sys_exit(self, status: Any = None) -> None:
        if status is None:
            code = 0
        elif isinstance(status, int):
            code = status & 0xFF
        else:
            code = 1  # sys.exit("message") prints the message and exits 1
        self._record(code, 0, "sys.exit", overwrite=True)
        if self._prev_exit is None:
            raise SystemExit(status)
        self._prev_exit(status)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        watch = self._watch
        if watch is not None:
            watch.handled()
        previous = self._prev_handlers.get(signum, signal.SIG_DFL)
        self._record(128 + signum, signum, "signal", overwrite=True)
        if callable(previous):
            # a handler of the user's (or the launcher's) decides what happens; atexit reports the end
            previous(signum, frame)
            return
        self._report()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _handler_installed(self, signum: int) -> Callable[[], bool]:
        def installed() -> bool:
            return bool(signal.getsignal(signum) == self._on_signal)
        return installed

    def _on_stuck(self, signum: int) -> None:
        """The signal arrived while the main thread is inside native code (signal_watch.py): report the
        exit from the watch's thread; the watch then ends the process with the default disposition."""
        self._record(128 + signum, signum, "signal", overwrite=True)
        self._report()

    def _atexit(self) -> None:
        self._report()

    # --- bookkeeping ----------------------------------------------------------------------------
    def _record(self, code: int, signum: int, reason: str, overwrite: bool = False) -> None:
        with self._lock:
            if self.reason == "normal" or overwrite:
                self.exit_code, self.signal, self.reason = code, int(signum), reason

    def _report(self) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
        client = self._client
        if client is None:
            return
        try:
            client.capture_lifecycle_exit(self.exit_code, self.signal, self.reason)
            client.close(client.options.shutdown_timeout)
        except Exception as exc:
            warn_once("exit", f"could not report the exit: {exc}")

