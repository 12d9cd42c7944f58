"""The SDK's promise to the training job: never raise into user code, and say each problem only once."""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Set, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_warned: Set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Print ``trainguard: <message>`` to stderr the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    try:
        sys.stderr.write(f"trainguard: {message}\n")
    except Exception:  # stderr closed at interpreter shutdown
        pass


def reset_warnings() -> None:
    """Forget what was warned (tests)."""
    with _warned_lock:
        _warned.clear()


def never_raise(default: Any = None) -> Callable[[F], F]:
    """Decorator: the wrapped SDK entry point returns ``default`` instead of raising anything.

    BaseExceptions that are not Exceptions (KeyboardInterrupt, SystemExit) still propagate: those are the
    user's, not ours.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # the SDK must never break the training loop
                warn_once(f"internal:{fn.__name__}:{type(exc).__name__}",
                          f"internal error in {fn.__name__} ({type(exc).__name__}: {exc}); continuing")
                return default

        return wrapper  # type: ignore[return-value]

    return decorate
