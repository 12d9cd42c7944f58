"""The integration contract (after sentry-python's ``Integration.setup_once``)."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Generic, List, Optional, Protocol, TypeVar

if TYPE_CHECKING:
    from ..client import Client


class DidNotEnable(Exception):
    """The integration cannot run here (library missing, not the main thread, ...); the message says why."""


class Integration(ABC):
    """Something installed into the process at ``init()`` and removed at ``shutdown()``."""

    identifier: str = "integration"

    @abstractmethod
    def setup(self, client: Client) -> None:
        """Install; raise DidNotEnable when it cannot."""

    def teardown(self) -> None:
        """Undo ``setup`` where possible (restore hooks and handlers)."""


def remove_hooks(handles: List[Any]) -> None:
    """Remove every torch hook handle in ``handles`` (one that fails is skipped) and empty the list."""
    for handle in handles:
        try:
            handle.remove()
        except Exception:
            pass
    handles.clear()


class Removable(Protocol):
    _client: Any

    def remove(self) -> None: ...


H = TypeVar("H", bound=Removable)


class WatchRegistry(Generic[H]):
    """The active watch of each model (weakly keyed: a model that goes away takes its entry with it).
    Watching a model again replaces -- removes -- its previous watch."""

    def __init__(self) -> None:
        self._active: weakref.WeakKeyDictionary[Any, H] = weakref.WeakKeyDictionary()

    def replace(self, model: Any, handle: H) -> None:
        """Make ``handle`` the watch of ``model``, removing the previous one."""
        previous = self._active.get(model)
        if previous is not None and previous is not handle:
            previous.remove()
        self._active[model] = handle

    def get(self, model: Any) -> Optional[H]:
        return self._active.get(model)

    def forget(self, model: Any, handle: H) -> None:
        """Drop ``model``'s entry if it is ``handle`` (called by the handle's own ``remove``)."""
        if self._active.get(model) is handle:
            del self._active[model]

    def remove_all(self, client: Optional[Any] = None) -> int:
        """Remove every active watch (of ``client`` only, when given); returns how many were removed."""
        removed = 0
        for handle in list(self._active.values()):
            if client is None or handle._client is client:
                handle.remove()
                removed += 1
        return removed
