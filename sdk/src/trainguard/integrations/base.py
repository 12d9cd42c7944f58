"""The integration contract (after sentry-python's ``Integration.setup_once``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

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
