"""Connection timeouts for the uvicorn servers (``trainguard serve``'s HTTP listener, the agent's).

uvicorn closes a connection only when it stays idle ``timeout_keep_alive`` seconds *after a response*; a
connection that never completes a request -- a fresh one that sends nothing, a half-sent request head (the
"slowloris" pattern), a body that stops arriving -- was held open for ever. :class:`TimeoutH11Protocol`
(uvicorn's h11 protocol plus timers) bounds each of those:

=============================  ================================================================  ========
what                            limit (a :class:`HttpTimeouts` field / setting)                   answer
=============================  ================================================================  ========
request head incomplete         ``header_s`` (``http_header_timeout_s``) from the connection or   408, close
                                from the first byte of the head, however slowly bytes trickle
request body stalls             ``body_idle_s`` (``http_body_timeout_s``) with no body byte while  408, close
                                the app is reading (not while the app itself holds the body back)
idle between requests           ``keep_alive_s`` (``http_keep_alive_s``; uvicorn's own timer)       close
=============================  ================================================================  ========

A 408 is only written when the response has not started; a connection with no byte received is just
closed. Once the request is read, nothing here limits how long the app takes or how long a response (an
SSE stream) lasts. The app sees a stalled upload as a client disconnect.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import Settings

__all__ = ["HttpTimeouts", "TimeoutH11Protocol", "protocol_class"]

_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"content-length: 15\r\nconnection: close\r\n\r\nRequest Timeout")


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds; see the module doc. Defaults are the settings' defaults."""

    header_s: float = Settings.model_fields["http_header_timeout_s"].default
    body_idle_s: float = Settings.model_fields["http_body_timeout_s"].default
    keep_alive_s: float = Settings.model_fields["http_keep_alive_s"].default

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpTimeouts:
        return cls(header_s=settings.http_header_timeout_s, body_idle_s=settings.http_body_timeout_s,
                   keep_alive_s=settings.http_keep_alive_s)


class TimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body-idle timers of the module doc (``timeouts`` is set on
    the subclass :func:`protocol_class` makes)."""

    timeouts = HttpTimeouts()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._body_timer: Optional[asyncio.TimerHandle] = None
        self._lingering: Optional[asyncio.TimerHandle] = None

    # --- uvicorn's hooks ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_timers()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # after a 400 for a malformed request: what the client still sends is dropped
        super().data_received(data)
        self._update_timers()

    def on_response_complete(self) -> None:
        """uvicorn arms its keep-alive timer here and hands the bytes of a pipelined request that arrived
        meanwhile to h11 (and the app). No byte may arrive after that, so the timers are armed here too: a
        next head already begun is held to ``header_s`` (with a 408, as when its bytes come later: the
        keep-alive timer, meant for an idle connection, is dropped), a next request whose body stalls to
        ``body_idle_s``. 1b37cf7 added this hook; 1a27038 dropped it unsaid, and a pipelined request whose
        body stopped after a few bytes was then held for ever (the app waiting, no timer armed; stop 44)."""
        super().on_response_complete()
        if self.transport.is_closing():
            return
        # only when the next cycle began (our side IDLE, or SEND_RESPONSE once its head was read): a request
        # answered before its body was read (our side DONE) keeps uvicorn's keep-alive timer, as before
        began = self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)
        if began and (self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]):
            self._unset_keepalive_if_required()  # not idle: the next request has begun
            self._update_timers()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 refuses (a request head past h11's 16 KiB while incomplete, bad
        framing), then a *lingering* close: the answer and a FIN go out, what the client still sends is read
        and dropped, and the connection closes when the client closes its side or after ``header_s``. uvicorn
        closed at once, so a client still sending its request (a 200 KB request line) got a reset and lost
        the answer (``bench/hostile_probe.py`` api/hostile-path-ids: status 0)."""
        if not self.transport.can_write_eof():
            super().send_400_response(msg)
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        event = h11.Response(status_code=400, reason=b"Bad Request", headers=headers)
        for part in (event, h11.Data(data=msg.encode("ascii")), h11.EndOfMessage()):
            self.transport.write(self.conn.send(part) or b"")
        self.transport.write_eof()  # the client's EOF then closes the transport (uvicorn's eof_received)
        self._cancel_header()
        self._cancel_body()
        self._lingering = self.loop.call_later(self.timeouts.header_s, self.transport.close)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header()
        self._cancel_body()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    # --- timers -------------------------------------------------------------------------------------
    def _update_timers(self) -> None:
        if self.transport.is_closing():
            self._cancel_header()
            self._cancel_body()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._header_timer is None:  # from the connection, or the first byte of the next head
                self._header_timer = self.loop.call_later(self.timeouts.header_s, self._header_expired)
        else:
            self._cancel_header()
        if state is h11.SEND_BODY:
            self._cancel_body()  # restarted: the deadline counts from the last byte
            self._body_timer = self.loop.call_later(self.timeouts.body_idle_s, self._body_expired)
        else:
            self._cancel_body()

    def _cancel_header(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _header_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._close(answer=bool(self.conn.trailing_data[0]))

    def _body_expired(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # the app holds the body back, not the client: wait for it
            self._body_timer = self.loop.call_later(self.timeouts.body_idle_s, self._body_expired)
            return
        cycle = self.cycle
        self._close(answer=cycle is None or not cycle.response_started)

    def _close(self, *, answer: bool) -> None:
        """End the connection, with a 408 first when ``answer``; the app (if any) sees a disconnect."""
        cycle = self.cycle
        if answer:
            self.transport.write(_REQUEST_TIMEOUT)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def protocol_class(timeouts: HttpTimeouts) -> type[TimeoutH11Protocol]:
    """A :class:`TimeoutH11Protocol` subclass using ``timeouts`` (uvicorn's ``Config(http=...)`` takes it)."""
    return type("TimeoutH11Protocol", (TimeoutH11Protocol,), {"timeouts": timeouts})
