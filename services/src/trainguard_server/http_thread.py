"""An ASGI app served by uvicorn on a daemon thread: what ``trainguard serve`` and ``trainguard agent`` run.

:class:`HttpThread` binds its socket in the constructor (port 0: a free one, read back as ``port``), so the
port is known before serving starts; :meth:`HttpThread.start` returns once uvicorn accepts connections (or
its thread died); :meth:`HttpThread.stop` asks it to finish and waits up to ``timeout`` seconds.

Connections are bounded in time by :mod:`.http_timeouts` (request head, stalled body, keep-alive): with
``timeouts`` given, those; else from the settings of the app's services (``app.state.services.settings``,
what :func:`~.api.app.create_app` builds, so ``TRAINGUARD_HTTP_*_TIMEOUT_S`` apply to ``trainguard serve``);
else the settings' defaults.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Optional

import uvicorn

from .config import Settings
from .http_timeouts import HttpTimeouts, protocol_class


def _timeouts_of(app: Any) -> HttpTimeouts:
    services = getattr(getattr(app, "state", None), "services", None)
    settings = getattr(services, "settings", None)
    return HttpTimeouts.from_settings(settings) if isinstance(settings, Settings) else HttpTimeouts()


class HttpThread:
    def __init__(self, app: Any, host: str, port: int, name: str, *,
                 timeouts: Optional[HttpTimeouts] = None) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)  # proto set: asyncio turns TCP_NODELAY on per connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port: int = sock.getsockname()[1]
        self.timeouts = timeouts if timeouts is not None else _timeouts_of(app)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=protocol_class(self.timeouts),
                                timeout_keep_alive=self.timeouts.keep_alive_s)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name=name,
                                       daemon=True)

    def start(self, pause: Callable[[float], Any] = time.sleep) -> None:
        """Serve; returns once uvicorn has started (``pause(s)`` waits between checks)."""
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            pause(0.02)

    def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
