"""Forward WARNING+ records of chosen loggers as log events (and their exc_info as exceptions)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Tuple

from ..core.events import safe_str
from .base import Integration

if TYPE_CHECKING:
    from ..client import Client

_SEVERITY = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING",
             logging.ERROR: "ERROR", logging.CRITICAL: "CRITICAL"}


class TrainGuardHandler(logging.Handler):
    """A logging handler that queues records as LogRecord events; never raises, never blocks."""

    def __init__(self, client: Client, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._client = client

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("trainguard"):
            return  # our own records would loop
        try:
            client = self._client
            limit = client.options.max_string_length
            severity = _SEVERITY.get(record.levelno, "WARNING")
            client.capture_event("log", {"logger": record.name, "level": record.levelname,
                                         "message": safe_str(record.getMessage(), limit),
                                         "source": "logging"}, severity=severity)
            if record.exc_info and record.exc_info[1] is not None:
                client.capture_exception(record.exc_info[1], handled=True, mechanism="log")
        except Exception:
            pass  # logging.Handler.handleError would print to stderr; we stay silent


class LoggingIntegration(Integration):
    """Attaches :class:`TrainGuardHandler` to ``options.log_loggers`` at ``options.log_level``."""

    identifier = "logging"

    def __init__(self) -> None:
        self._attached: List[Tuple[logging.Logger, logging.Handler]] = []
        self._handler: Optional[TrainGuardHandler] = None

    def setup(self, client: Client) -> None:
        level = logging.getLevelName(client.options.log_level.upper())
        handler = TrainGuardHandler(client, level if isinstance(level, int) else logging.WARNING)
        self._handler = handler
        for name in client.options.log_loggers:
            logger = logging.getLogger(name or None)
            logger.addHandler(handler)
            self._attached.append((logger, handler))

    def teardown(self) -> None:
        for logger, handler in self._attached:
            logger.removeHandler(handler)
        self._attached.clear()
